"""A tool killed outright leaves no children behind: core.children's run_child and start_child under kill -9, and
every benchmark starting its processes through them."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from processes import is_alive, wait_gone

pytestmark = pytest.mark.crash

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"

PARENT = textwrap.dedent("""
    import subprocess, sys
    from worldpipe.core.children import run_child, start_child
    child = [sys.executable, "-c", "import time; time.sleep(120)"]
    if sys.argv[1] == "start":
        started = start_child(child)
        print(started.pid, flush=True)
        started.wait()
    elif sys.argv[1] == "run":
        # run_child does not say its child's pid: the child prints its own first
        run_child([sys.executable, "-c", "import os, time; print(os.getpid(), flush=True); time.sleep(120)"])
    else:  # the baseline this module guards against
        started = subprocess.Popen(child)
        print(started.pid, flush=True)
        started.wait()
""")


def _kill_parent_and_find_child(how: str, wait_s: float = 10) -> tuple[int, set[int]]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, how], stdout=subprocess.PIPE, text=True,
                              start_new_session=True)
    try:
        child = int(parent.stdout.readline())
        assert is_alive(child)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        assert parent.returncode == -signal.SIGKILL
        return child, wait_gone({child}, timeout=wait_s)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


@pytest.mark.parametrize("how", ["start", "run"])
def test_a_child_dies_with_the_process_that_started_it(how):
    child, survivors = _kill_parent_and_find_child(how)
    assert not survivors, f"child {child} outlived its parent's kill -9"


def test_a_plain_popen_child_outlives_its_killed_parent_the_failure_guarded_against():
    # The guarded children are gone within a fraction of a second; 2 s is ample to see this one is not.
    child, survivors = _kill_parent_and_find_child("plain", wait_s=2)
    try:
        assert survivors == {child}
    finally:
        if is_alive(child):
            os.kill(child, signal.SIGKILL)
        wait_gone({child}, timeout=10)


def _direct_process_starts(tree: ast.AST) -> list[str]:
    """Calls of subprocess.run/Popen/call/check_call/check_output in a module's source."""
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "subprocess"
                and node.func.attr in {"run", "Popen", "call", "check_call", "check_output"}):
            found.append(f"line {node.lineno}: subprocess.{node.func.attr}")
    return found


def test_every_benchmark_starts_its_processes_through_core_children():
    offenders = {path.name: calls for path in sorted(BENCHMARKS.glob("*.py"))
                 if (calls := _direct_process_starts(ast.parse(path.read_text())))}
    assert not offenders, f"benchmarks starting processes that would outlive them: {offenders}"


def test_every_torchrun_rank_of_a_benchmark_dies_with_torchrun():
    """torchrun starts each rank in a session of its own and a SIGKILLed torchrun signals none of them: each
    script a benchmark hands to torchrun (its own file, or a sibling it names) arms its own lifeline."""
    missing = []
    for path in sorted(BENCHMARKS.glob("*.py")):
        text = path.read_text()
        for call in re.findall(r"torchrun_argv\((.*)", text):
            named = re.search(r'with_name\("([^"]+)"\)', call)
            script = BENCHMARKS / named.group(1) if named else path
            assert named or "__file__" in call, f"{path.name}: which script does torchrun run? {call}"
            if "die_with_parent()" not in script.read_text():
                missing.append(script.name)
    assert not missing, f"torchrun ranks that would outlive a killed benchmark: {missing}"


@pytest.mark.slow
def test_a_killed_bench_loop_leaves_no_training_run_behind(tmp_path):
    """The case that was found: `worldpipe bench loop` stopped by a signal left its current `worldpipe train`."""
    bench = subprocess.Popen([sys.executable, "-m", "worldpipe.cli", "bench", "loop", "--steps", "20000",
                              "--rounds", "1", "--no-compile", "--out", str(tmp_path / "loop.json")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    children: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not children:
            children = _train_children(bench.pid)
            time.sleep(0.2)
        assert children, "bench loop started no training run within 240 s"
        os.kill(bench.pid, signal.SIGKILL)
        bench.wait(timeout=30)
        assert not wait_gone(children, timeout=15), "a training run outlived the killed benchmark"
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()
        for pid in children:
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)


def _train_children(pid: int) -> set[int]:
    """The processes ``pid`` has started and not yet reaped (its bare loop or training runs)."""
    found = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found |= {int(kid) for kid in (task / "children").read_text().split()}
        except OSError:
            continue
    return found
