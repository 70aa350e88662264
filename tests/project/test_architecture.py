"""The map of rooms in docs/architecture.md, enforced: every import of worldpipe (also those inside functions)
runs from a room to one it may import, no module imports itself through a circle, and the package root holds
only entry points. Change ALLOWED together with the doc's table."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "worldpipe"

# room -> rooms it may import (besides itself). Lower rooms never import higher ones.
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "config": {"core", "measure"},
    "data": {"core", "config"},
    "parallel": {"core", "config"},
    "models": {"core", "config", "parallel"},
    "measure": {"core"},
    "checkpoint": {"core", "config", "parallel"},
    "tracking": {"core", "config"},
    "trainer": {"core", "config", "data", "parallel", "models", "measure", "checkpoint", "tracking"},
    "evaluate": {"core", "config", "data", "models", "measure", "checkpoint", "tracking"},
    "launch": {"core", "config", "data", "measure", "tracking", "trainer"},
    "pipeline": {"core", "config", "data", "checkpoint", "tracking", "trainer", "launch"},
    "rollout": {"core", "config", "data", "models", "measure", "checkpoint", "evaluate"},
    "control": {"core", "config", "data", "models", "measure", "checkpoint", "tracking", "evaluate", "launch",
                "rollout"},
    "reproduce": {"core", "config", "data", "checkpoint", "tracking", "trainer", "evaluate", "launch", "control"},
    "commands": {"core", "config", "data", "parallel", "models", "measure", "checkpoint", "tracking", "trainer",
                 "evaluate", "launch", "pipeline", "rollout", "control", "reproduce"},
}
ROOT_ENTRY_POINTS = {"__init__", "cli"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path) -> list[tuple[str, int]]:
    """(absolute module, line) for every worldpipe import in the file, wherever it stands."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from worldpipe.x import y` may import the module worldpipe.x.y
            for alias in node.names:
                candidate = f"{target}.{alias.name}"
                is_module = (SRC / Path(*candidate.split("."))).with_suffix(".py").exists() or (
                    SRC / Path(*candidate.split(".")) / "__init__.py").exists()
                found.append((candidate if is_module else target, node.lineno))
    return [(m, line) for m, line in found if m == "worldpipe" or m.startswith("worldpipe.")]


def room_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and (PACKAGE / parts[1]).is_dir()) else None


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {name: imported_modules(path) for name, path in MODULES.items()}


def test_every_room_is_on_the_map():
    rooms = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert rooms == set(ALLOWED), "rooms and the ALLOWED map (and docs/architecture.md) differ"


def test_package_root_holds_only_entry_points():
    loose = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem not in ROOT_ENTRY_POINTS)
    assert not loose, f"modules at the package root belong in a room: {loose}"


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_room_imports_only_rooms_below_it(room):
    wrong = []
    for name, imports in GRAPH.items():
        if room_of(name) != room:
            continue
        for target, line in imports:
            other = room_of(target)
            if other not in (None, room) and other not in ALLOWED[room]:
                wrong.append(f"{MODULES[name].relative_to(SRC)}:{line} imports {target}")
    assert not wrong, f"{room} may import only {sorted(ALLOWED[room])}:\n" + "\n".join(wrong)


def test_no_import_cycles():
    edges = {name: {t for t, _ in imports if t in MODULES and t != name} for name, imports in GRAPH.items()}
    # A package __init__ reached on the way to its own submodule is not an edge of the submodule's code.
    cycles, state, stack = [], {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = "done"

    for node in sorted(edges):
        if node not in state:
            visit(node)
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_map_itself_has_no_cycle_and_core_is_the_base():
    assert ALLOWED["core"] == set()
    for room, allowed in ALLOWED.items():
        for other in allowed:
            assert room not in ALLOWED[other], f"{room} and {other} may import each other"


def test_imports_inside_functions_say_why():
    """A worldpipe import inside a function hides an edge from a reading of the module's head; it stays only
    where it saves start-up time (torch, zarr, MLflow), with a comment saying so. Command modules import lazily
    as a rule (every `worldpipe` invocation loads them all), documented in commands/__init__.py."""
    unexplained = []
    for name, path in MODULES.items():
        if room_of(name) == "commands":
            continue
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, ast.Import | ast.ImportFrom) or node.col_offset == 0:
                continue
            target = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            if not (getattr(node, "level", 0) or (target or "").startswith("worldpipe")):
                continue
            context = " ".join(lines[max(0, node.lineno - 3):node.lineno]).lower()
            if not any(word in context for word in ("start-up", "torch", "zarr", "mlflow")):
                unexplained.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert not unexplained, "function-level imports without a start-up reason:\n" + "\n".join(unexplained)
