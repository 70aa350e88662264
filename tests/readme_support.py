"""The README's shell commands, parsed, and a fresh copy of the project to run them in.

A command is run unless the README marks it, visibly: a trailing ``# not run by tests: <why>``, or a comment line
``# not run by tests: <why>`` that covers the rest of its block. Shared by the README test and the session
fixture that runs the README's own smoke and sweep pipelines once for every test that reads their results.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARKER = "# not run by tests:"
# Seconds each, no results needed: run by test_cheap_readme_commands_run_as_written, before any pipeline.
CHEAP = (r"^source \.venv/bin/activate$", r"^snakemake -n\b", r"^snakemake --dag \| dot ", r"^worldpipe sweep points ",
         r"^worldpipe train --cfg ", r"^worldpipe train --help", r"^eval \"\$\(worldpipe train -sc install=bash\)\"")
# The README's pipelines that make the results the other commands read: run first in the slow tier.
SETUP = (r"^snakemake --cores 2 --configfile conf/pipeline/smoke\.yaml",
         r"^snakemake --cores 2 --configfile conf/pipeline/sweep_smoke\.yaml")
ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=\S+(\s+#.*)?$")


@dataclasses.dataclass
class Command:
    text: str          # as the README has it (continuations joined), without a trailing marker
    line: int          # README line of its first line
    skipped: str | None  # the marker's reason, or None
    prelude: tuple[str, ...]  # shell assignments earlier in its block (`data=...`)

    @property
    def tier(self) -> str:
        if self.skipped is not None:
            return "skipped"
        if any(re.search(p, self.text) for p in SETUP):
            return "setup"
        return "cheap" if any(re.search(p, self.text) for p in CHEAP) else "slow"


def _complete(text: str) -> bool:
    if text.endswith("\\"):
        return False
    try:
        shlex.split(text, comments=True)
    except ValueError:  # an open quote: the command goes on (curl's JSON body)
        return False
    return True


def _block_commands(lines: list[tuple[int, str]], console: bool) -> list[Command]:
    commands: list[Command] = []
    prelude: list[str] = []
    block_reason: str | None = None
    pending: list[tuple[int, str]] = []
    for number, raw in lines:
        if console:
            if not raw.startswith("$ "):
                continue
            raw = raw[2:]
        if not pending:
            stripped = raw.strip()
            if not stripped:
                block_reason = None
                continue
            if stripped.startswith("#"):
                if stripped.startswith(MARKER):
                    block_reason = stripped[len(MARKER):].strip()
                continue
        pending.append((number, raw))
        text = "\n".join(part for _, part in pending)
        if not _complete(text):
            continue
        first, pending = pending[0][0], []
        reason = block_reason
        if MARKER in text:
            text, reason = (part.strip() for part in text.split(MARKER, 1))
        if ASSIGNMENT.match(text):
            prelude.append(text.split("#", 1)[0].strip())
            continue
        commands.append(Command(text, first, reason, tuple(prelude)))
    return commands


def readme_commands(readme: Path = REPO / "README.md") -> list[Command]:
    """Every command of the README's ``bash``/``console`` blocks, in order."""
    commands: list[Command] = []
    block: list[tuple[int, str]] | None = None
    console = False
    for number, line in enumerate(readme.read_text().splitlines(), 1):
        if block is None and re.match(r"^```(bash|sh|console)\s*$", line):
            block, console = [], line.strip().endswith("console")
        elif block is not None and line.startswith("```"):
            commands += _block_commands(block, console)
            block = None
        elif block is not None:
            block.append((number, line))
    return commands


def fresh_copy(root: Path) -> Path:
    """The project's files as a fresh clone has them (tracked and not ignored), with the venv linked in."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                            capture_output=True).stdout.decode().split("\0")
    project = root / "project"
    for rel in filter(None, listed):
        source = REPO / rel
        if source.is_file():
            (project / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, project / rel)
    (project / ".venv").symlink_to(Path(os.environ.get("VIRTUAL_ENV") or REPO / ".venv").resolve())
    return project


def run_in(project: Path, command: Command, env: dict[str, str], substitutions: dict[str, str] | None = None,
           timeout: float = 900) -> subprocess.CompletedProcess:
    script = "\n".join(["set -euo pipefail", *command.prelude, command.text])
    for placeholder, value in (substitutions or {}).items():
        script = script.replace(placeholder, value)
    proc = subprocess.run(["bash", "-c", script], cwd=project, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, (f"README line {command.line}: `{command.text}` exited {proc.returncode}\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc




def project_env(root: Path, env_with_venv: dict[str, str]) -> tuple[Path, dict[str, str]]:
    """A fresh copy of the project and the environment its own checkout would run with (its src, its conf)."""
    project = fresh_copy(root)
    env = dict(env_with_venv, PYTHONPATH=str(project / "src"))
    env.pop("WORLDPIPE_CONF_DIR", None)
    return project, env


def run_readme_pipelines(project: Path, env: dict[str, str]) -> None:
    """The README's setup commands (its smoke and sweep pipelines), as written, in the project copy."""
    setup = [c for c in readme_commands() if c.tier == "setup"]
    assert len(setup) == len(SETUP), f"README setup commands changed: {[c.text for c in setup]}"
    for command in setup:
        run_in(project, command, env, timeout=1800)
