"""Retention planning (pure)."""

import pytest

from worldpipe.checkpoint.manager import select_deletions


def _all_intact(_step):
    return True


@pytest.mark.parametrize("steps, current, keep_last, keep_every, intact, expected", [
    ([1, 2, 3], 3, 2, None, None, [1]),
    ([1, 2, 3, 4, 5, 6], 6, 3, None, None, [1, 2, 3]),
    ([10, 20, 30, 40, 50], 50, 2, 20, None, [10, 30]),
    ([1, 2, 3], 3, 2, None, {1, 3}, [2]),  # damaged 2 does not count as the fallback: 1 is kept
    ([1, 2, 3, 9], 3, 2, None, None, [1]),  # 9 is newer than the step just saved: untouched
    ([3], 3, 2, None, None, []),
    ([1, 2, 3], 3, 5, None, None, []),
])
def test_select_deletions(steps, current, keep_last, keep_every, intact, expected):
    is_intact = _all_intact if intact is None else intact.__contains__
    assert select_deletions(steps, current, keep_last, keep_every, is_intact) == expected


def test_never_deletes_current_nor_newest_intact():
    for n in range(1, 8):
        steps = list(range(1, n + 1))
        for current in steps:
            doomed = select_deletions(steps, current, 2, None, _all_intact)
            assert current not in doomed
            assert max(steps) not in doomed
