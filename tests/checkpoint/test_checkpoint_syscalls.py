"""Durability from the real system calls: a save traced with strace publishes in the order docs/architecture.md requires.

Atomicity (readers see all or nothing) is tested by the crash tests; this checks durability (the bytes and
the names reach the disk before anything points at them), for a full save and for a sharded one (FSDP2 on a
one-rank gloo group): both go through the one protocol of worldpipe.checkpoint.publication.
"""

import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

SYSCALLS = "fsync,fdatasync,rename,renameat,renameat2,openat,unlink,unlinkat"
_LINE = re.compile(r"^(\d+)\s+(.*)$")
_CALL = re.compile(r"^(\w+)\((.*)$")
_RESUMED = re.compile(r"^<\.\.\. (\w+) resumed>(.*)$")
_FD_PATH = re.compile(r"^\d+<([^>]*)>")
_QUOTED = re.compile(r'"((?:[^"\\]|\\.)*)"')

SCRIPTS = {"full": textwrap.dedent("""
    import sys
    from worldpipe.checkpoint import CheckpointManager
    from checkpoint_states import example_state
    cm = CheckpointManager(sys.argv[1], keep_last=2)
    for step in (1, 2):
        cm.save(step, example_state(seed=step, ranks=2))
    open(sys.argv[1] + "-strace-mark", "w").close()  # separates setup from the save checked below
    cm.save(3, example_state(seed=3, ranks=2))
"""), "sharded": textwrap.dedent("""
    import sys
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from worldpipe.checkpoint import CheckpointManager
    from worldpipe.checkpoint.sharded_saver import ShardedSaver
    from checkpoint_states import example_state
    from sharded_support import fsdp_toy_model
    dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1] + "-pg", 1), rank=0, world_size=1)
    model, opt = fsdp_toy_model()
    saver = ShardedSaver(CheckpointManager(sys.argv[1], keep_last=2))

    def state(step):
        return {**example_state(seed=step, ranks=2), "model": get_model_state_dict(model),
                "optimizer": get_optimizer_state_dict(model, opt)}

    for step in (1, 2):
        saver.save(step, state(step))
    open(sys.argv[1] + "-strace-mark", "w").close()  # separates setup from the save checked below
    saver.save(3, state(3))
    dist.destroy_process_group()
""")}
SUBDIRS = {"full": ["rng"], "sharded": ["rng", "shards"]}


def _events(trace_text):
    """(name, args, ok) of each completed system call, in completion order."""
    pending: dict[tuple[str, str], str] = {}
    events = []
    for raw in trace_text.splitlines():
        match = _LINE.match(raw)
        if not match:
            continue
        pid, rest = match.groups()
        if rest.endswith("<unfinished ...>"):
            call = _CALL.match(rest)
            if call:
                pending[(pid, call.group(1))] = call.group(2)[: -len("<unfinished ...>")]
            continue
        resumed = _RESUMED.match(rest)
        if resumed:
            name, tail = resumed.groups()
            args = pending.pop((pid, name), "") + tail
        else:
            call = _CALL.match(rest)
            if not call:
                continue
            name, args = call.groups()
        result = args.rsplit("=", 1)[-1].strip()
        events.append((name, args, result.startswith("0") or result[:1].isdigit()))
    return events


def _fsynced(args):
    match = _FD_PATH.match(args.strip())
    return match.group(1) if match else None


@pytest.fixture(scope="module", params=sorted(SCRIPTS))
def trace(request, tmp_path_factory):
    if shutil.which("strace") is None:
        pytest.skip("strace not installed (apt-get install strace)")
    tmp = tmp_path_factory.mktemp("strace")
    root = tmp / "ck"
    out = tmp / "trace.txt"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("WORLDPIPE_CKPT_FAULT", None)
    result = subprocess.run(
        ["strace", "-f", "-y", "-qq", "-e", f"trace={SYSCALLS}", "-o", str(out), sys.executable, "-c",
         SCRIPTS[request.param], str(root)], env=env, capture_output=True, text=True, timeout=120)
    if result.returncode != 0 and "ptrace" in result.stderr:
        pytest.skip(f"strace cannot trace here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stderr
    events = _events(out.read_text())
    mark = next(i for i, (name, args, _) in enumerate(events) if name == "openat" and f'{root}-strace-mark"' in args)
    return str(root), events[mark + 1:], request.param


def _index(events, predicate, what):
    for i, event in enumerate(events):
        if predicate(*event):
            return i
    raise AssertionError(f"no system call for: {what}")


def test_publication_order(trace):
    root, events, kind = trace
    final = f"{root}/step-000003"
    publish = _index(events, lambda n, a, ok: n.startswith("rename") and ok and f'"{final}"' in a,
                     "rename of the partial dir to step-000003")
    partial = _QUOTED.findall(events[publish][1])[0]
    assert os.path.basename(partial).startswith(".step-000003.partial-")

    # 1. every file of the step was fsynced (under its partial path) before the rename
    published = [os.path.relpath(os.path.join(d, f), final) for d, _, fs in os.walk(final) for f in fs]
    assert "MANIFEST.json" in published and "rng/rank-00001.pt" in published
    assert kind == "full" or {"shards/rank-00000.pt", "shards/index.json"} <= set(published)
    for rel in published:
        done = _index(events, lambda n, a, ok, rel=rel: n in ("fsync", "fdatasync") and ok
                      and _fsynced(a) == f"{partial}/{rel}", f"fsync of {rel}")
        assert done < publish, rel
    # the manifest is fsynced after every data file
    manifest = _index(events, lambda n, a, ok: n == "fsync" and _fsynced(a) == f"{partial}/MANIFEST.json", "")
    for rel in published:
        if rel != "MANIFEST.json":
            assert _index(events, lambda n, a, ok, rel=rel: n == "fsync" and _fsynced(a) == f"{partial}/{rel}",
                          rel) < manifest
    # 2. the subdirectories and then the partial dir itself were fsynced before the rename
    pdir = _index(events, lambda n, a, ok: n == "fsync" and _fsynced(a) == partial, "fsync of the partial dir")
    for name in SUBDIRS[kind]:
        sub = _index(events, lambda n, a, ok, name=name: n == "fsync" and _fsynced(a) == f"{partial}/{name}",
                     f"fsync of {name}/")
        assert sub < manifest < pdir < publish
    # 3. the checkpoints dir was fsynced after the rename
    root_sync = _index(events[publish:], lambda n, a, ok: n == "fsync" and _fsynced(a) == root,
                       "fsync of checkpoints/ after the rename") + publish
    # 4. latest: temp file written and fsynced, renamed over `latest`, then checkpoints/ fsynced
    latest = _index(events, lambda n, a, ok: n.startswith("rename") and f'"{root}/latest"' in a, "rename to latest")
    tmp = _QUOTED.findall(events[latest][1])[0]
    assert os.path.basename(tmp).startswith(".latest.tmp-")
    tmp_sync = _index(events, lambda n, a, ok: n == "fsync" and _fsynced(a) == tmp, "fsync of the latest temp")
    assert root_sync < tmp_sync < latest
    assert _index(events[latest:], lambda n, a, ok: n == "fsync" and _fsynced(a) == root, "fsync after latest")
    # 5. retention (step 1 goes) starts only after the new step and `latest` are durable
    doomed = _index(events, lambda n, a, ok: n.startswith("rename") and f'"{root}/step-000001"' in a,
                    "retention rename of step-000001")
    assert doomed > latest
    first_unlink = _index(events, lambda n, a, ok: n.startswith("unlink") and "step-000001" in a, "unlink")
    assert first_unlink > doomed
