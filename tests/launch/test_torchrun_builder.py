"""One torchrun command-line builder (worldpipe.launch.torchrun.torchrun_argv): no other module of src/ or
benchmarks/ spells out a torchrun command line, so none can drift back to ``--standalone`` (which listens on
every interface) or to a rendezvous of its own."""

from __future__ import annotations

import ast
from pathlib import Path

from worldpipe.launch.torchrun import torchrun_argv

REPO = Path(__file__).resolve().parents[2]
BUILDER = REPO / "src/worldpipe/launch/torchrun.py"
# Words of a torchrun command line: its module or executable, and its options (not --rdzv-endpoint/--rdzv-id,
# which `worldpipe train` takes too).
TORCHRUN_MODULE = "torch.distributed.run"
TORCHRUN_OPTIONS = ("--standalone", "--nproc-per-node", "--nproc_per_node", "--nnodes", "--rdzv-backend",
                    "--rdzv_backend", "--rdzv-conf", "--rdzv_conf", "--master-addr",
                    "--master_addr", "--master-port", "--master_port", "--max-restarts", "--max_restarts")


def _docstrings(tree: ast.AST) -> set[int]:
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef))]
    return {id(node.body[0].value) for node in nodes
            if node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}


def torchrun_words(source: str) -> list[tuple[int, str]]:
    """(line, what) for every piece of a torchrun command line built in this source (docstrings aside)."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            text = node.value
            if text.startswith(TORCHRUN_OPTIONS) or text == TORCHRUN_MODULE:
                found.append((node.lineno, text))
        elif isinstance(node, ast.Call) and any(isinstance(a, ast.Constant) and a.value == "torchrun"
                                                for a in node.args):
            found.append((node.lineno, "the torchrun executable"))  # with_name("torchrun"), which("torchrun")
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names = [node.module] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            if TORCHRUN_MODULE in names:
                found.append((node.lineno, f"import of {TORCHRUN_MODULE}"))
    return sorted(found, key=lambda item: item[0])  # stable: in walk order within a line


def test_no_torchrun_command_line_outside_the_builder():
    offenders = []
    for path in sorted([*(REPO / "src").rglob("*.py"), *(REPO / "benchmarks").rglob("*.py")]):
        if path == BUILDER:
            continue
        offenders += [f"{path.relative_to(REPO)}:{line}: {what}" for line, what in torchrun_words(path.read_text())]
    assert offenders == [], "build torchrun command lines with worldpipe.launch.torchrun.torchrun_argv:\n" + \
        "\n".join(offenders)


def test_the_scan_finds_each_kind_of_hand_built_command_line():
    source = '''
"""Docstring: torchrun --standalone --nproc-per-node 2 is only prose here."""
import subprocess, sys
from torch.distributed.run import main
cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", "x.py"]
exe = Path(sys.executable).with_name("torchrun")
'''
    assert sorted(torchrun_words(source)) == [
        (4, "import of torch.distributed.run"), (5, "--nproc_per_node="), (5, "--standalone"),
        (5, "torch.distributed.run"), (6, "the torchrun executable")]


def test_builder_uses_a_loopback_c10d_rendezvous():
    cmd = torchrun_argv(2, ["script.py", "--flag"])
    assert "--standalone" not in cmd and "--rdzv-backend=c10d" in cmd
    assert next(a for a in cmd if a.startswith("--rdzv-endpoint=")).startswith("--rdzv-endpoint=127.0.0.1:")
    assert cmd[-2:] == ["script.py", "--flag"] and cmd[2] == "worldpipe.launch.torchrun"
    nodes = torchrun_argv(1, ["-m", "m"], nnodes=2, rdzv_endpoint="10.0.0.7:24242", rdzv_id="slurm-7")
    assert {"--nnodes=2", "--rdzv-endpoint=10.0.0.7:24242", "--rdzv-id=slurm-7"} <= set(nodes)
