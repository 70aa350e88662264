"""A throwaway copy of the project's Snakefile, conf/ and workflow/ for tests that edit the config.

The copy uses the installed worldpipe package; its Snakefile composes (and its training jobs read) the copy's
conf/ tree, so editing the copy changes what runs without touching the checkout.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import yaml

from worldpipe.pipeline.plan import plan


def plan_of(repo: Path, configfile: Path):
    """(datasets, runs) a pipeline config file asks for, composed from the checkout's conf/."""
    return plan(yaml.safe_load(configfile.read_text()), repo / "conf")


class Project:
    """A copied project directory and a separate working directory Snakemake runs in."""

    def __init__(self, repo: Path, root: Path, env: dict[str, str]):
        self.src = root / "project"
        self.work = root / "work"
        self.env = env
        self.src.mkdir(parents=True)
        self.work.mkdir(parents=True)
        shutil.copy2(repo / "Snakefile", self.src / "Snakefile")
        for tree in ("conf", "workflow"):
            shutil.copytree(repo / tree, self.src / tree)
        self.configfile = root / "pipeline.yaml"

    def write_config(self, config: dict) -> None:
        self.configfile.write_text(yaml.safe_dump(config, sort_keys=False))

    def config(self) -> dict:
        return yaml.safe_load(self.configfile.read_text())

    def plan(self):
        """(datasets, runs) the copy's current config asks for."""
        return plan(self.config(), self.src / "conf")

    def command(self, *args: str) -> list[str]:
        # Targets and flags first: after --configfile, Snakemake would read them as more config files.
        return ["snakemake", *args, "-s", str(self.src / "Snakefile"), "--directory", str(self.work), "--cores", "2",
                "--configfile", str(self.configfile)]

    def snakemake(self, *args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(*args), env=env or self.env, capture_output=True, text=True,
                              timeout=timeout)

    def start(self, *args: str, env: dict | None = None) -> subprocess.Popen:
        """Snakemake in a process group of its own (so the test can kill -9 it with its jobs)."""
        return subprocess.Popen(self.command(*args), env=env or self.env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)

    def edit(self, rel: str, old: str, new: str) -> None:
        path = self.src / rel
        text = path.read_text()
        assert old in text, f"{old!r} not in {rel}"
        path.write_text(text.replace(old, new, 1))


def bare_report(repo: Path, workdir: Path, env: dict[str, str], timeout: float = 600) -> subprocess.CompletedProcess:
    """`snakemake --report results/report.html` in ``workdir`` naming no config (-s and --directory only locate)."""
    cmd = ["snakemake", "-s", str(repo / "Snakefile"), "--directory", str(workdir), "--report", "results/report.html"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def _report_var(html: str, name: str) -> dict:
    """A JSON object the Snakemake HTML report embeds as `var NAME = {...};`."""
    match = re.search(rf"^\s*var {name} = (\{{.*\}});\s*$", html, re.M)
    assert match, f"the report embeds no `var {name}`"
    return json.loads(match.group(1))


def _toggle_labels(labels_of: list[dict]) -> set[str]:
    """Labels Snakemake's report turns into a toggle (rows hidden behind a switch: one more click).

    Its rule (report template, AbstractResults.getData): every label but the first whose values, over the rows
    that have it, are exactly two, each on half of all the rows.
    """
    order: dict[str, int] = {}
    for labels in labels_of:
        for i, key in enumerate(labels):
            order.setdefault(key, i)
    toggles = set()
    for key in sorted(order, key=order.get)[1:]:
        values = [labels[key] for labels in labels_of if key in labels]
        if len(set(values)) == 2 and all(values.count(v) * 2 == len(labels_of) for v in set(values)):
            toggles.add(key)
    return toggles


def report_clicks(html: str) -> dict[str, tuple[int, str, dict]]:
    """Each result of a Snakemake HTML report: (clicks from the opened report to its plot, category, labels).

    The menu lists the categories (one click); a category with several subcategories lists them (one more); the
    result table's row opens the plot (one more); a row behind a toggle needs the toggle too.
    """
    categories, results = _report_var(html, "categories"), _report_var(html, "results")
    clicks = {}
    for category, subcategories in categories.items():
        for paths in subcategories.values():
            labels_of = [results[path].get("labels") or {} for path in paths]
            hidden = 1 if _toggle_labels(labels_of) else 0
            for path, labels in zip(paths, labels_of, strict=True):
                clicks[path] = (1 + (len(subcategories) > 1) + 1 + hidden, category, labels)
    return clicks


def planned_jobs(dry_run_output: str) -> set[tuple[str, str]]:
    """(rule, experiment) of every job a `snakemake -n` output lists (experiment '' for data jobs)."""
    jobs = set()
    rule = None
    for line in dry_run_output.splitlines():
        head = re.match(r"^(?:local)?rule (\w+):", line.strip())
        if head:
            rule = head.group(1)
            jobs.add((rule, ""))
            continue
        wildcards = re.search(r"wildcards: .*experiment=([\w.-]+)", line)
        if wildcards and rule:
            jobs.discard((rule, ""))
            jobs.add((rule, wildcards.group(1)))
    return jobs


def seed_datasets(source: Path, workdir: Path) -> None:
    """Copy the datasets a finished pipeline in ``source`` made into ``workdir`` (mtimes kept), so that Snakemake
    there runs only the stages after them (e.g. the SLURM tests need not build the data again as SLURM jobs).
    Same spec, same directory, same bytes."""
    shutil.copytree(source / "results/data", workdir / "results/data")


def files_of(directory: Path) -> dict[str, tuple[int, int]]:
    """Every file below a directory with its size and modification time in ns (to see it untouched)."""
    return {str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry))
    return children


def _descendants(root: int) -> set[int]:
    children, found, stack = _children(), set(), [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add(child)
            stack.append(child)
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """kill -9 a process started by Project.start and everything below it, by PID.

    torchrun starts its workers in sessions of their own, so killing Snakemake's process group would leave
    them running: stop the tree first (so nothing new is started), collect it until it stops growing, kill it.
    """
    stopped: set[int] = set()
    os.kill(proc.pid, signal.SIGSTOP)
    while True:
        fresh = _descendants(proc.pid) - stopped
        if not fresh:
            break
        for pid in fresh:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)
        stopped |= fresh
    for pid in [proc.pid, *stopped]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=60)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and any(_alive(pid) for pid in stopped):
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    """True while a process exists and is not a zombie (a zombie holds no files or locks)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def dry_run(repo: Path, workdir: Path, env: dict, config: dict) -> subprocess.CompletedProcess:
    """`snakemake -n` of the project's Snakefile in ``workdir`` with ``config`` as its config file."""
    workdir.mkdir(parents=True, exist_ok=True)
    configfile = workdir / "pipeline.yaml"
    configfile.write_text(yaml.safe_dump(config, sort_keys=False))
    cmd = ["snakemake", "-s", str(repo / "Snakefile"), "--directory", str(workdir), "--cores", "1",
           "--configfile", str(configfile), "-n"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
