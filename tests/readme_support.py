"""The shell commands of the README and the docs pages, parsed, and a fresh copy of the project to run them in.

Every command of a ``bash``/``sh``/``console`` block is run unless the line just above its block is an HTML
comment ``<!-- not run by tests: <why> -->``: GitHub and the docs site show no comment, so the text a reader sees
and copies carries no test annotation. Shared by the commands test and the session fixture that runs the smoke
and sweep pipelines of the docs once for every test that reads their results.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
MARKER = "not run by tests:"
SKIP_COMMENT = re.compile(r"^<!--\s*not run by tests:\s*(?P<why>.*?)\s*-->\s*$")
FENCE = re.compile(r"^```(bash|sh|console)\s*$")
# Seconds each, no results needed: run by test_cheap_readme_commands_run_as_written, before any pipeline.
CHEAP = (r"^source \.venv/bin/activate$", r"^snakemake -n\b", r"^snakemake --dag \| dot ", r"^worldpipe sweep points ",
         r"^worldpipe train --cfg ", r"^worldpipe train --help", r"^eval \"\$\(worldpipe train -sc install=bash\)\"")
# The docs' pipelines that make the results the other commands read, run first in the slow tier, in this order
# (the sweep's, then the smoke pipeline's: a bare report then renders the smoke run).
SETUP = (r"^snakemake --cores 2 --configfile conf/pipeline/sweep_smoke\.yaml",
         r"^snakemake --cores 2 --configfile conf/pipeline/smoke\.yaml")
# The slow tier runs the pages in this order, not the nav's: first the commands that read the pipelines' results
# as they were made (runs list, tracking, rerun, compare), then those that train more runs beside them. A page
# not named here runs after these, in nav order.
RUN_ORDER = ("README.md", "docs/reproducibility.md", "docs/numerics.md", "docs/tracking.md", "docs/sweeps.md",
             "docs/pipeline.md", "docs/checkpoints.md", "docs/configuration.md", "docs/parallel.md")
ASSIGNMENT = re.compile(r"^[A-Za-z_]\w*=\S+(\s+#.*)?$")


@dataclasses.dataclass
class Command:
    text: str          # as the page has it (continuations joined)
    page: str          # the page, relative to the repository (README.md, docs/pipeline.md)
    line: int          # line of its first line in the page
    skipped: str | None  # the reason of the comment above its block, or None
    prelude: tuple[str, ...]  # shell assignments earlier in its block (`data=...`)

    @property
    def where(self) -> str:
        return f"{self.page} line {self.line}"

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


def _block_commands(page: str, lines: list[tuple[int, str]], console: bool, reason: str | None) -> list[Command]:
    commands: list[Command] = []
    prelude: list[str] = []
    pending: list[tuple[int, str]] = []
    for number, raw in lines:
        if console:
            if not raw.startswith("$ "):
                continue
            raw = raw[2:]
        if not pending and (not raw.strip() or raw.strip().startswith("#")):
            continue
        pending.append((number, raw))
        text = "\n".join(part for _, part in pending)
        if not _complete(text):
            continue
        first, pending = pending[0][0], []
        if ASSIGNMENT.match(text):
            prelude.append(text.split("#", 1)[0].strip())
            continue
        commands.append(Command(text, page, first, reason, tuple(prelude)))
    return commands


def pages() -> list[str]:
    """The README, then every page of the docs site in nav order (paths relative to the repository)."""
    config = yaml.safe_load((REPO / "mkdocs.yml").read_text())
    docs_dir = config.get("docs_dir", "docs")

    def flatten(entries) -> list[str]:
        found: list[str] = []
        for entry in entries:
            value = next(iter(entry.values())) if isinstance(entry, dict) else entry
            found += flatten(value) if isinstance(value, list) else [f"{docs_dir}/{value}"]
        return found

    return ["README.md", *flatten(config["nav"])]


@dataclasses.dataclass
class Page:
    commands: list[Command]
    stray_markers: list[int]      # lines of a skip comment not directly above a shell block
    annotated_lines: list[int]    # lines inside a shell block that mention the marker (the reader would copy it)
    indented_blocks: list[int]    # shell blocks indented (in a list item): not parsed, so not allowed


def parse_page(page: str) -> Page:
    """Every command of the page's ``bash``/``sh``/``console`` blocks, in order, and misplaced markers."""
    parsed = Page([], [], [], [])
    block: list[tuple[int, str]] | None = None
    console = False
    reason: str | None = None
    marker_line = 0
    for number, line in enumerate((REPO / page).read_text().splitlines(), 1):
        if block is None:
            opens = FENCE.match(line)
            if marker_line and not opens:
                parsed.stray_markers.append(marker_line)
            if opens:
                block, console = [], line.strip().endswith("console")
                block_reason, reason, marker_line = reason, None, 0
                continue
            if re.match(r"^\s+```(bash|sh|console)\s*$", line):
                parsed.indented_blocks.append(number)
            skip = SKIP_COMMENT.match(line)
            reason, marker_line = (skip["why"], number) if skip else (None, 0)
        elif line.startswith("```"):
            parsed.commands += _block_commands(page, block, console, block_reason)
            block = None
        else:
            if MARKER in line:
                parsed.annotated_lines.append(number)
            block.append((number, line))
    if marker_line:
        parsed.stray_markers.append(marker_line)
    return parsed


def readme_commands() -> list[Command]:
    """Every command of the README's and the docs pages' shell blocks, page by page in nav order."""
    return [command for page in pages() for command in parse_page(page).commands]


def in_run_order(commands: list[Command]) -> list[Command]:
    """The commands page by page in RUN_ORDER (pages it does not name after, in nav order), each page in order."""
    listed = {page: index for index, page in enumerate(RUN_ORDER)}
    return sorted(commands, key=lambda c: listed.get(c.page, len(RUN_ORDER)))  # stable: nav order otherwise


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
    assert proc.returncode == 0, (f"{command.where}: `{command.text}` exited {proc.returncode}\n"
                                  f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc




def project_env(root: Path, env_with_venv: dict[str, str]) -> tuple[Path, dict[str, str]]:
    """A fresh copy of the project and the environment its own checkout would run with (its src, its conf)."""
    project = fresh_copy(root)
    env = dict(env_with_venv, PYTHONPATH=str(project / "src"))
    env.pop("WORLDPIPE_CONF_DIR", None)
    return project, env


def run_readme_pipelines(project: Path, env: dict[str, str]) -> None:
    """The docs' setup commands (the sweep and smoke pipelines), as written, in the project copy, in SETUP order."""
    setup = [c for c in readme_commands() if c.tier == "setup"]
    assert len(setup) == len(SETUP), f"the docs' setup commands changed: {[(c.where, c.text) for c in setup]}"
    setup.sort(key=lambda c: next(i for i, p in enumerate(SETUP) if re.search(p, c.text)))
    for command in setup:
        run_in(project, command, env, timeout=1800)
