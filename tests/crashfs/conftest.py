"""Fixtures of the crash-simulating file system's tests: a fresh mount per test, stopped by PID."""

from __future__ import annotations

import pytest

from crashfs.mount import CrashMount, unavailable


@pytest.fixture
def crashfs(tmp_path):
    """A mounted crash-simulating file system (``.path``: its mount point), unmounted after the test."""
    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    mount = CrashMount(tmp_path / "crashfs").mount()
    try:
        yield mount
    finally:
        mount.unmount()
