"""Code and environment drift: is this checkout the code a recorded run was trained with?"""

from __future__ import annotations

import hashlib
import logging

from worldpipe.core import provenance as ident
from worldpipe.core.errors import EXIT_FAILURE, EXIT_USAGE
from worldpipe.tracking.history import RecordedRun

log = logging.getLogger("worldpipe.rerun")


class RerunError(RuntimeError):
    """The run cannot be rebuilt faithfully; the message says why and what to do (exit 2)."""

    exit_code = EXIT_USAGE


class RerunTrainingFailed(RerunError):
    """The retraining itself failed (exit 1, as a failed `worldpipe train`); its own line said why."""

    exit_code = EXIT_FAILURE


def code_drift(recorded: RecordedRun) -> list[str]:
    """Differences between the recorded code/environment and this checkout (empty: same code)."""
    rec_code = recorded.identity.get("code_version", {})
    cur_code = ident.code_version()
    problems = []
    if rec_code.get("git_sha") != cur_code.get("git_sha"):
        problems.append(f"git SHA: recorded {rec_code.get('git_sha')}, checkout {cur_code.get('git_sha')}")
    rec_diff = recorded.tags.get("worldpipe.git_diff_sha256") if rec_code.get("git_dirty") else None
    cur_diff = hashlib.sha256(ident.git_diff().encode()).hexdigest() if cur_code.get("git_dirty") else None
    if rec_diff != cur_diff:
        problems.append(f"uncommitted changes: recorded {_short(rec_diff) or 'none'}, checkout {_short(cur_diff) or 'none'}"
                        " (the recorded diff is the artifact code/git_diff.patch)")
    rec_versions, cur_versions = recorded.identity.get("versions", {}), ident.package_versions()
    for name in sorted(set(rec_versions) | set(cur_versions)):
        if rec_versions.get(name) != cur_versions.get(name):
            problems.append(f"{name}: recorded {rec_versions.get(name)}, installed {cur_versions.get(name)}")
    if recorded.identity.get("lock_hash") != ident.lock_hash():
        problems.append(f"requirements.lock: recorded {_short(recorded.identity.get('lock_hash'))}, "
                        f"checkout {_short(ident.lock_hash())}")
    return problems


def _short(text: str | None) -> str | None:
    return text[:12] if text else text


def check_code(recorded: RecordedRun, allow_drift: bool) -> str | None:
    """Raise RerunError on drift unless allowed; returns the drift description to record (None: no drift)."""
    problems = code_drift(recorded)
    if not problems:
        return None
    text = "; ".join(problems)
    if not allow_drift:
        sha = recorded.identity.get("code_version", {}).get("git_sha")
        raise RerunError(
            f"code differs from the one run {recorded.run_id} was trained with:\n  " + "\n  ".join(problems)
            + f"\ncheck out {sha} (and apply its code/git_diff.patch artifact, install its "
            "environment/requirements.lock), or pass --allow-code-drift to proceed and record the drift")
    log.warning("proceeding despite code drift (recorded on the new run): %s", text)
    return text
