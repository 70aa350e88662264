"""Mutation probe: break one promised behaviour at a time and check that the named tests notice.

Each mutant is a minimal textual change to the source (found by its exact text, anywhere under ``src/``, so it
keeps working when code moves between modules). For each mutant the probe copies the working tree into a
temporary directory, applies the change there, and runs the named tests with the *default* pytest options
(slow tests deselected) against the copy: ``PYTHONPATH`` points at the copy's ``src/``, so the torchrun ranks
and CLI subprocesses the tests start run the mutated code too. The working tree is never modified.

    .venv/bin/python tests/mutation_probe.py                 # every mutant
    .venv/bin/python tests/mutation_probe.py first_never_hashes rng_rank_index
    .venv/bin/python tests/mutation_probe.py --list

A mutant is *caught* when its tests fail, *survived* when they pass, and an *error* when they could not run
(nothing collected, a mutant whose text is no longer in the source, ...). First, unless ``--no-baseline``, the
tests are run unmutated: they must pass there or the verdicts mean nothing. Exit status: 0 if every mutant was
caught, 1 otherwise. See docs/testing.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from worldpipe.models.native import EXTENSIONS_DIR_ENV

REPO = Path(__file__).resolve().parents[1]
TEST_TIMEOUT_S = 900  # per mutant: the whole set of named tests


@dataclass(frozen=True)
class Mutant:
    """One minimal break: replace ``old`` (which must occur exactly once under src/) by ``new``."""

    name: str
    promise: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTANTS = (
    Mutant("rng_rank_index", "every rank resumes with the RNG state it saved",
           "restore_rng(rng[self.runtime.rank]", "restore_rng(rng[0]",
           ("tests/trainer/test_rng_resume.py::test_each_rank_gets_back_the_rng_state_it_saved",)),
    Mutant("first_never_hashes", "verify=first hashes a step the first time it is selected",
           'return (self.root, step, manifest["manifest_sha256"]) not in _fully_verified',
           "return False",
           ("tests/checkpoint/test_checkpoint_verify_modes.py",)),
    Mutant("restore_skips_numpy", "restore_rng restores NumPy's global generator",
           "np.random.set_state(tuple(from_portable(rng[NUMPY_GLOBAL_STREAM])))", "pass",
           ("tests/checkpoint/test_checkpoint_state.py",)),
    Mutant("manifest_checksum_ignored", "a damaged MANIFEST.json is never trusted",
           "if claimed != actual:", "if False:",
           ("tests/checkpoint/test_checkpoint_manager.py",)),
    Mutant("retention_ignores_intact", "retention keeps keep_last intact checkpoints",
           "        if is_intact(step):\n            keep.add(step)",
           "        if True:\n            keep.add(step)",
           ("tests/checkpoint/test_checkpoint_retention.py", "tests/checkpoint/test_checkpoint_manager.py")),
    Mutant("failed_commit_kept", "a save that fails before its commit leaves nothing of the new step, full or sharded",
           "            self.writer.discard()\n            if isinstance(exc, OSError):",
           "            if isinstance(exc, OSError):",
           ("tests/checkpoint/test_checkpoint_publication.py",)),
    Mutant("async_durable_at_next_save", "an async save's records go once it is published, not one cadence later",
           "if self._undurable and self.manager.writer.durable:", "if False:",
           ("tests/checkpoint/test_checkpoint_async.py::"
            "test_poll_reports_an_async_save_durable_once_published_not_at_the_next_save",)),
    Mutant("fsdp2_filter_layers_sharded", "under FSDP2 the RSSM trains the one fused filter, on whole weights",
           'whole_in_forward = ("cell_input", "cell", "posterior_head")', "whole_in_forward = ()",
           ("tests/models/test_rssm.py",)),
    Mutant("sampler_cursor_not_restored", "the sampler resumes at the saved cursor",
           "        self.epoch = epoch\n        self.cursor = cursor",
           "        self.epoch = epoch\n        self.cursor = 0",
           ("tests/data/test_data_sampler.py",)),
    Mutant("rank_slice_overlaps", "ranks take disjoint slices of the global batch",
           "return slice(start, start + base + (1 if rank < extra else 0))",
           "return slice(start, start + base + 1)",
           ("tests/data/test_data_sampler.py",)),
    Mutant("loss_local_count", "every rank's loss is normalised by the valid steps of the whole global batch",
           'self.layout.forward_backward(self.loss_fn, part, batch["global_valid"],',
           'self.layout.forward_backward(self.loss_fn, part, int(part["mask"].sum()),',
           ("tests/parallel/test_dist_parallel.py::"
            "test_trainer_step_on_unequal_slices_follows_the_global_mean_gradient",)),
    Mutant("model_key_resume_safe", "only resume-safe keys may change on resume: model keys are the run's identity",
           '    "run_dir",\n)', '    "run_dir",\n    "model.hidden",\n)',
           ("tests/config/test_config_identity.py",)),
    Mutant("preemption_skips_checkpoint", "SIGTERM/SIGUSR1 checkpoint the step the run stops at, then exit 75",
           "final = self.progress.step == self.settings.steps or preempted",
           "final = self.progress.step == self.settings.steps",
           ("tests/trainer/test_preemption_quick.py",)),
    Mutant("eval_key_ignores_horizon", "an evaluation is identified by digest, held-out data, context and horizon",
           'self.result["context"],\n                 self.result["horizon"])', 'self.result["context"])',
           ("tests/tracking/test_tracking_comparison.py::test_each_part_of_the_key_makes_another_evaluation",)),
    Mutant("fault_die_exits_cleanly", "an injected kill is a SIGKILL, not an exit (the crash tests prove it landed)",
           "os.kill(os.getpid(), signal.SIGKILL)\n", "os._exit(1)\n",
           ("tests/checkpoint/test_publish_crash.py::test_sigkill_at_phase",)),
    Mutant("dir_fsync_skipped", "publication is durable: the directory is fsynced after a rename",
           "os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)\n    try:\n        os.fsync(fd)",
           "os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)\n    try:\n        pass",
           ("tests/checkpoint/test_checkpoint_syscalls.py",)),
    Mutant("ckpt_manifest_dir_unsynced", "a published checkpoint survives a power cut: the partial directory is "
           "fsynced once its manifest is written (`_PartialDir.stage_manifest`)",
           "write_file_durably(self.path(layout.MANIFEST_NAME), [data])\n        fsync_dir(self.dir)",
           "write_file_durably(self.path(layout.MANIFEST_NAME), [data])\n        pass",
           ("tests/crashfs/test_checkpoint_durability.py",)),
    Mutant("seal_dirs_unsynced", "a sealed dataset survives a power cut: sealing fsyncs the directories above "
           "the store (`seal_dataset`)",
           "        fsync_ancestors(store_root)\n", "        pass\n",
           ("tests/crashfs/test_store_durability.py::test_every_cut_of_a_dataset_build_leaves_it_sealed_and_verified_or_unsealed",)),
    Mutant("spool_append_unsynced", "an appended record survives a power cut: the journal is fsynced before "
           "append returns (`append_durably`)",
           "        write_all(fd, data)\n        os.fsync(fd)\n", "        write_all(fd, data)\n",
           ("tests/crashfs/test_store_durability.py::test_every_cut_of_the_spool_keeps_every_acknowledged_record",)),
    Mutant("causal_mask_dropped", "the transformer attends causally (no step sees its future)",
           "F.scaled_dot_product_attention(q, k, v, is_causal=True)",
           "F.scaled_dot_product_attention(q, k, v, is_causal=False)",
           ("tests/models/test_sequence_models.py",)),
    Mutant("cache_key_ignores_sampling", "a cached rollout draw is reused only for the same sampling config",
           "return (self.model_version, self.initial_state, prefix, self.sampling, self.stream)",
           "return (self.model_version, self.initial_state, prefix, self.stream)",
           ("tests/rollout/test_rollout_cache.py",)),
    Mutant("compiled_core_drops_sample_path", "the compiled filter's backward is the Python reference's, to the bit",
           "d_mean[c] = g_mean.row(r)[c] + dz;",
           "d_mean[c] = g_mean.row(r)[c];",
           ("tests/models/test_rssm.py",)),
    Mutant("portable_pins_nothing", "a portable run's every process runs the pinned code paths",
           'pinned_now = numerics.pin(cfg.get("numerics"))', "pinned_now = []",
           ("tests/trainer/test_numerics_identity.py::"
            "test_portable_digests_are_equal_whatever_code_path_the_environment_forces",)),
    Mutant("compiled_core_on_any_device", "the compiled filter core never receives another device's tensors",
           'if compiled and example.device.type == "cpu" and native_filter_core() is not None:',
           "if compiled and native_filter_core() is not None:",
           ("tests/core/test_numerics.py",)),
    Mutant("portable_optimizer_unfused", "the portable mode's optimizer step is the fused kernel (exact sqrt)",
           'options = {**{k: v for k, v in options.items() if k != "foreach"}, "fused": True}', "pass",
           ("tests/core/test_numerics.py",)),
    Mutant("planner_unseeded", "a closed-loop decision draws only from its recorded stream (reruns bit-identically)",
           "action = self.planner.plan(self.dynamics, seed_for_step(self.stream, step, self.generator), timing)",
           "action = self.planner.plan(self.dynamics, self.generator, timing)",
           ("tests/control/test_control_planners.py",)),
    Mutant("planner_ignores_model", "the planner scores candidates by the imagined rewards",
           "returns = (rewards * discounts).sum(dim=1)", "returns = torch.zeros(rewards.shape[0])",
           ("tests/control/test_control_planners.py",)),
    Mutant("value_without_bootstrap", "each backup of the planner's value looks one horizon further ahead",
           "backed_up = backed_up + discount**horizon * value(imagined[:, -1])", "backed_up = backed_up + 0.0",
           ("tests/control/test_value.py",)),
    Mutant("actor_without_model_gradients", "the value's actor learns through the model's gradients",
           "model.imagine_step(state, (actor(current) + noise).clamp(low, high))",
           "model.imagine_step(state, (actor(current) + noise).clamp(low, high).detach())",
           ("tests/control/test_value.py",)),
)


def copy_tree(dest: Path) -> None:
    """The files git would carry (tracked and untracked-not-ignored), as they are in the working tree now."""
    listed = subprocess.run(["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def apply(mutant: Mutant, root: Path) -> str:
    """Apply ``mutant`` under ``root/src``; returns the relative path changed. ValueError if not exactly once."""
    sources = [p for pattern in ("*.py", "*.cpp") for p in (root / "src").rglob(pattern)]  # compiled parts too
    hits = [p for p in sources if mutant.old in p.read_text()]
    count = sum(p.read_text().count(mutant.old) for p in hits)
    if count != 1:
        raise ValueError(f"mutant {mutant.name}: its text occurs {count} times under src/ (expected once); "
                         "update MUTANTS in tests/mutation_probe.py")
    path = hits[0]
    path.write_text(path.read_text().replace(mutant.old, mutant.new))
    return str(path.relative_to(root))


def run_tests(root: Path, tests: tuple[str, ...], own_build: bool = False) -> tuple[int, str]:
    """Run ``tests`` in ``root`` with the default pytest options; returns (exit status, output tail).

    ``own_build``: compiled extensions are built inside ``root`` (a mutated C++ source never lands in the venv).
    """
    env = dict(os.environ, PYTHONPATH=str(root / "src"), PYTHONDONTWRITEBYTECODE="1")
    if own_build:
        env[EXTENSIONS_DIR_ENV] = str(root / ".extensions")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    # One process: under xdist, -x ends an interrupted session (exit 2), which would read as "error", not "caught".
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", *tests]
    try:
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=TEST_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return -1, f"timed out after {TEST_TIMEOUT_S} s"
    return proc.returncode, (proc.stdout + proc.stderr)[-1500:]


def verdict(status: int) -> str:
    # pytest: 0 all passed, 1 some failed; anything else (2-5, timeout) means the tests did not run properly.
    return {0: "survived", 1: "caught"}.get(status, "error")


def probe(mutant: Mutant) -> dict:
    """Apply one mutant to a fresh copy and run its tests."""
    with tempfile.TemporaryDirectory(prefix=f"mutant-{mutant.name}-") as tmp:
        root = Path(tmp)
        copy_tree(root)
        try:
            where = apply(mutant, root)
        except ValueError as err:
            return {"mutant": mutant.name, "verdict": "error", "detail": str(err)}
        start = time.monotonic()
        status, tail = run_tests(root, mutant.tests, own_build=where.endswith(".cpp"))
        return {"mutant": mutant.name, "file": where, "verdict": verdict(status), "pytest_status": status,
                "seconds": round(time.monotonic() - start, 1), "detail": tail if verdict(status) != "caught" else ""}


def baseline(mutants: list[Mutant]) -> tuple[int, str]:
    tests = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
    with tempfile.TemporaryDirectory(prefix="mutant-baseline-") as tmp:
        copy_tree(Path(tmp))
        return run_tests(Path(tmp), tests)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="print the mutants and their tests, run nothing")
    parser.add_argument("--no-baseline", action="store_true", help="skip the unmutated run of the tests")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    known = {m.name: m for m in MUTANTS}
    unknown = [n for n in args.names if n not in known]
    if unknown:
        print(f"error: unknown mutant(s) {unknown}; known: {sorted(known)}", file=sys.stderr)
        return 2
    chosen = [known[n] for n in args.names] if args.names else list(MUTANTS)
    if args.list:
        for m in chosen:
            print(f"{m.name:30} {m.promise}\n{'':30} tests: {' '.join(m.tests)}")
        return 0
    if not args.no_baseline:
        status, tail = baseline(chosen)
        if status != 0:
            print(f"error: the named tests do not pass unmutated (pytest exit {status}):\n{tail}", file=sys.stderr)
            return 2
        print("baseline: the named tests pass unmutated", flush=True)
    results = []
    for mutant in chosen:
        result = probe(mutant)
        results.append(result)
        print(f"{result['verdict']:9} {mutant.name:30} {result.get('seconds', '-'):>6} s  {mutant.promise}", flush=True)
        if result["detail"]:
            print("    " + result["detail"].strip().replace("\n", "\n    ")[-800:])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    caught = sum(r["verdict"] == "caught" for r in results)
    print(f"{caught}/{len(results)} mutants caught")
    return 0 if caught == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
