"""The numerics environment: what decides a run's floating-point bits besides its code, packages and config.

The same code and config give other bits on another CPU: ATen picks its vector kernels by the CPU's instruction
set (its CPU capability), MKL picks a code path by the CPU (``MKL_CBWR``), oneDNN by its maximum ISA, and every
threaded reduction by the thread count; on a GPU the device, CUDA, cuDNN and NCCL versions and the deterministic
settings decide. :func:`environment` reads all of them for one process; a run records it beside its identity (not
in its digest), and :func:`differences` names what differs between two records, so a rerun or a resume on
another machine says so before it trains instead of reporting a bare mismatch afterwards.

The portable mode (``conf/numerics/portable.yaml``) pins the CPU-side choices through environment variables
(:func:`pin`) that each library reads once, at its first kernel: they are set in the launcher before anything
computes, and torchrun's workers inherit them. Any x86 CPU with AVX2 and FMA then runs the same code paths.
See docs/architecture.md, "Numerics identity".
"""

from __future__ import annotations

import os
import platform
import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from worldpipe.core.errors import UserError

# Config key (numerics group) -> the environment variable it sets; read by the library once, at its first use.
PIN_VARIABLES: dict[str, str] = {
    "mkl_cbwr": "MKL_CBWR",                       # MKL's code path (COMPATIBLE: the same on every x86 CPU)
    "aten_cpu_capability": "ATEN_CPU_CAPABILITY",  # ATen's vector kernels (can only lower the CPU's own)
    "onednn_max_cpu_isa": "ONEDNN_MAX_CPU_ISA",    # oneDNN's kernels (convolutions of the pixel models)
}
# cuBLAS is deterministic only with a fixed workspace (torch.use_deterministic_algorithms refuses otherwise).
CUBLAS_WORKSPACE = ("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
# The CPU flags that select code paths in ATen, MKL and oneDNN.
ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "asimd", "sve")
# Capability name (ATEN_CPU_CAPABILITY's value) -> the CPU flags it needs.
CAPABILITY_NEEDS = {"avx2": ("avx2", "fma"), "avx512": ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
                    "default": ()}
# Where a run's identity (every checkpoint, identity.json) keeps its environment, and each resume onto another.
IDENTITY_KEY, CHANGES_KEY = "numerics", "numerics_changes"
# Tolerances of a rerun on another numerics environment (`worldpipe rerun --rtol/--ratio-tol`): float32 training
# drifts from rounding-level differences (1e-7) at a rate set by the run's length and learning rate; these hold
# the smoke runs' measured spread (docs/architecture.md, "Numerics identity").
DEFAULT_RTOL, DEFAULT_RATIO_TOL = 1e-2, 5e-2
# Fields that describe the machine without deciding bits by themselves (shown, never compared).
INFORMATIONAL = ("cpu.count",)


class NumericsError(UserError, RuntimeError):
    """A pinned numerics setting cannot hold in this process; the message names the setting and the fix."""


def pinned_variables(settings: Mapping[str, Any] | None) -> dict[str, str]:
    """The environment variables a numerics config sets (none for the native mode)."""
    settings = settings or {}
    return {var: str(settings[key]) for key, var in PIN_VARIABLES.items() if settings.get(key) not in (None, "")}


def pin(settings: Mapping[str, Any] | None) -> list[str]:
    """Set the numerics config's variables in this process (children inherit them); the names that changed.

    Effective for everything this process computes afterwards: ATen, MKL and oneDNN read them at their first
    kernel, not at import. A process that already computed keeps its code paths: :func:`check_pinned` says so.
    """
    changed = []
    for var, value in pinned_variables(settings).items():
        if os.environ.get(var) != value:
            os.environ[var] = value
            changed.append(var)
    return changed


def cpu_info() -> dict[str, str]:
    """Vendor, model name and the code-path-deciding ISA flags of this CPU (from /proc/cpuinfo where present)."""
    vendor, model, flags = platform.processor() or "unknown", platform.machine(), set()
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key == "vendor_id":
            vendor = value
        elif key == "model name":
            model = value
        elif key in ("flags", "Features") and not flags:
            flags = set(value.split())
    return {"cpu.vendor": vendor, "cpu.model": model, "cpu.isa": " ".join(f for f in ISA_FLAGS if f in flags)}


def _library_versions(config_text: str) -> dict[str, str]:
    blas = re.search(r"BLAS_INFO=(\w+)", config_text)
    mkl = re.search(r"Math Kernel Library Version ([\d.]+)", config_text)
    onednn = re.search(r"MKL-DNN v([\d.]+)", config_text)
    name = blas.group(1) if blas else "unknown"
    return {"blas": f"{name} {mkl.group(1)}" if name == "mkl" and mkl else name,
            "onednn.version": onednn.group(1) if onednn else "absent"}


def environment(device: str = "cpu") -> dict[str, str]:
    """This process's numerics environment as flat ``field: value`` strings (recorded with every run).

    Read after the trainer has set its threads and deterministic settings; ``device`` is the training device.
    """
    import torch  # imported on use: the launcher's refusals and the CLI's start-up do without torch

    env = cpu_info()
    env.update({
        "cpu.count": str(os.cpu_count()),
        "aten.cpu_capability": torch.backends.cpu.get_cpu_capability(),
        **_library_versions(torch.__config__.show()),
        "mkl.cbwr": os.environ.get("MKL_CBWR") or "AUTO",
        "onednn.max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA") or "ALL",
        "torch.threads": str(torch.get_num_threads()),
        "torch.deterministic": str(torch.are_deterministic_algorithms_enabled()),
        "device": str(device).split(":")[0],
    })
    if str(device).startswith("cuda") and torch.cuda.is_available():
        env.update(_cuda_environment(torch, torch.device(device)))
    return env


def _cuda_environment(torch, device) -> dict[str, str]:
    major, minor = torch.cuda.get_device_capability(device)
    try:
        nccl = ".".join(str(part) for part in torch.cuda.nccl.version())
    except (AttributeError, RuntimeError):
        nccl = "absent"
    return {
        "cuda.device": torch.cuda.get_device_name(device),
        "cuda.capability": f"{major}.{minor}",
        "cuda.version": str(torch.version.cuda),
        "cudnn.version": str(torch.backends.cudnn.version()),
        "nccl.version": nccl,
        "cuda.cudnn_deterministic": str(torch.backends.cudnn.deterministic),
        "cuda.cudnn_benchmark": str(torch.backends.cudnn.benchmark),
        "cuda.tf32": f"matmul={torch.backends.cuda.matmul.allow_tf32} cudnn={torch.backends.cudnn.allow_tf32}",
        "cuda.cublas_workspace": os.environ.get(CUBLAS_WORKSPACE[0]) or "unset",
    }


def expected_environment(config: Mapping[str, Any]) -> dict[str, str]:
    """The environment a training of the resolved ``config`` would record in this process and on this machine.

    Pins the config's numerics here first (this process then trains or evaluates that config), and takes the
    threads and deterministic settings the trainer would set.
    """
    pin(config.get("numerics"))
    import torch  # imported on use: the launcher's refusals and the CLI's start-up do without torch

    trainer = config.get("trainer") or {}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and trainer.get("deterministic", True):
        set_deterministic_cuda()
    env = environment(device)
    env["torch.threads"] = str(trainer.get("threads_per_rank", env["torch.threads"]))
    env["torch.deterministic"] = str(bool(trainer.get("deterministic", True)))
    return env


def set_deterministic_cuda() -> None:
    """The settings torch needs for bitwise-repeatable CUDA training; call before the first CUDA kernel.

    cuDNN picks algorithms by timing unless told not to; TF32 would round float32 products; cuBLAS needs a fixed
    workspace for deterministic reductions. A no-op for the CPU's kernels.
    """
    os.environ.setdefault(*CUBLAS_WORKSPACE)
    if "torch" not in sys.modules:
        return
    import torch  # already loaded by the caller (see above): no start-up cost

    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def check_pinned(settings: Mapping[str, Any] | None) -> None:
    """Raise NumericsError unless this process runs the pinned code paths (a portable run's every process).

    The variables must be set, and ATen must have taken the capability: it cannot raise a CPU's own, so a CPU
    without AVX2 and FMA cannot run the portable mode's kernels.
    """
    wanted = pinned_variables(settings)
    for var, value in wanted.items():
        if os.environ.get(var) != value:
            raise NumericsError(f"numerics: {var} is {os.environ.get(var)!r} in this process, the config pins "
                                f"{value!r}; start training through `worldpipe train` (it sets the variables "
                                "before any process computes)")
    capability = wanted.get("ATEN_CPU_CAPABILITY")
    if capability is None:
        return
    flags = set(cpu_info()["cpu.isa"].split())
    missing = [f for f in CAPABILITY_NEEDS.get(capability.lower(), ()) if f not in flags]
    if missing:
        raise NumericsError(f"numerics: this CPU lacks {', '.join(missing)}, which ATEN_CPU_CAPABILITY="
                            f"{capability} (numerics.aten_cpu_capability) needs; this machine cannot run the "
                            "portable mode's code paths")
    import torch  # the trainer has loaded it already: no start-up cost

    if torch.backends.cpu.get_cpu_capability().lower() != capability.lower():
        raise NumericsError(f"numerics: ATen runs {torch.backends.cpu.get_cpu_capability()} kernels in this "
                            f"process, the config pins {capability} (set before torch's first kernel)")


def differences(recorded: Mapping[str, Any] | None, current: Mapping[str, Any] | None) -> list[str]:
    """``field: recorded X, here Y`` for every bit-deciding field that differs (empty: the same environment).

    A record without the field (a run from before it was recorded) counts as unknown, and differs.
    """
    if not recorded:
        return ["numerics environment: not recorded by the original run"]
    lines = []
    for key in sorted(set(recorded) | set(current or {})):
        if key in INFORMATIONAL:
            continue
        before, after = recorded.get(key, "<unrecorded>"), (current or {}).get(key, "<unrecorded>")
        if str(before) != str(after):
            lines.append(f"{key}: recorded {before!r}, here {after!r}")
    return lines


def summary(env: Mapping[str, Any] | None) -> str:
    """A short readable name of an environment (for tables): CPU capability, MKL path, device."""
    if not env:
        return "-"
    parts = [str(env.get("aten.cpu_capability", "?")), f"cbwr={env.get('mkl.cbwr', '?')}"]
    if env.get("device", "cpu") != "cpu":
        parts.append(str(env.get("cuda.device", env.get("device"))))
    return " ".join(parts)
