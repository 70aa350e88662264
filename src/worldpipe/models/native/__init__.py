"""Compiled parts of the models: the RSSM filter's loops over time in C++ (``filter_core.cpp``).

The extension computes what the Python reference (:mod:`worldpipe.models.rssm_filter`) computes, to the bit: its
products call the BLAS gemm ATen's matmuls call, and its element-wise loops ATen's own vector functions with the
same fused multiply-adds, so it is built for the CPU capability ATen dispatches to (``compiler_flags``); what the
compiled loop removes is the cost around each small operator. It is built with torch's C++ extension toolchain
(a C++ compiler and ninja) once per source version and CPU capability, by ``make install`` (``python -m
worldpipe.models.native``) or by the first process that needs it, and later processes import the built library
directly. Where it cannot be built the Python reference runs instead (same results, slower) and one warning line
says why.

Build layout: ``$WORLDPIPE_EXTENSIONS_DIR`` or ``<sys.prefix>/share/worldpipe/extensions``, one folder per
extension and hash of its source, torch version and flags, published by rename after a complete build (a build
killed half-way leaves only a ``.partial`` folder, removed by the next build); a file lock makes concurrent first
uses (torchrun ranks) build once.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch

EXTENSIONS_DIR_ENV = "WORLDPIPE_EXTENSIONS_DIR"
SOURCES = {"filter_core": Path(__file__).with_name("filter_core.cpp")}
_log = logging.getLogger(__name__)


def extensions_dir() -> Path:
    """Where built extensions live: $WORLDPIPE_EXTENSIONS_DIR, else inside the installed environment."""
    return Path(os.environ.get(EXTENSIONS_DIR_ENV) or Path(sys.prefix) / "share" / "worldpipe" / "extensions")


# Compiler flags per CPU capability ATen dispatches its kernels to: the extension's element-wise loops use
# ATen's vector functions and its fused multiply-adds, so they are built for the same instruction set
# (filter_core.cpp, "Element-wise kernels"); -ffp-contract=off keeps every other sum and product unfused.
_CAPABILITY_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY_AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-DCPU_CAPABILITY_AVX2"],
}


def cpu_capability() -> str:
    """The instruction set ATen runs its CPU kernels with here (``ATEN_CPU_CAPABILITY`` can lower it)."""

    return torch.backends.cpu.get_cpu_capability()


def compiler_flags() -> list[str]:
    """Flags of a build for this machine's ATen CPU capability."""
    capability = cpu_capability()
    flags = _CAPABILITY_FLAGS.get(capability, [])
    name = capability if flags else "DEFAULT"
    return ["-O3", "-ffp-contract=off", f"-DCPU_CAPABILITY={name}", *flags]


def _versioned_name(extension: str) -> str:
    """The module name of one source version (its Python init symbol and folder name)."""
    source = SOURCES[extension].read_bytes()

    stamp = source + torch.__version__.encode() + " ".join(compiler_flags()).encode()
    digest = hashlib.sha256(stamp).hexdigest()[:12]
    return f"worldpipe_{extension}_{digest}"


def _import_library(name: str, library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build(extension: str) -> Path:
    """Compile ``extension`` unless its current version is built; the path of its shared library."""
    from filelock import FileLock

    name = _versioned_name(extension)
    root = extensions_dir()
    final = root / name
    library = final / f"{name}.so"
    if library.exists():
        return library
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(root / f"{name}.lock"):
        if library.exists():  # built by another process while this one waited
            return library
        compiler = os.environ.get("CXX", "c++")  # torch's extension toolchain reads the same variable
        if shutil.which(compiler) is None:
            raise RuntimeError(f"no C++ compiler {compiler!r} on PATH")
        partial = root / f".{name}.partial"
        shutil.rmtree(partial, ignore_errors=True)  # a build killed half-way
        partial.mkdir()
        from torch.utils.cpp_extension import load

        try:
            load(name, [str(SOURCES[extension])], extra_cflags=compiler_flags(), build_directory=str(partial),
                 verbose=False)
            os.replace(partial, final)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    return library


@functools.cache
def load_extension(extension: str) -> ModuleType | None:
    """The built extension module (building it first if needed), or None, with one warning, if it cannot be built."""
    try:
        library = build(extension)
        return _import_library(library.stem, library)  # the file is named by its module (one hash per process)
    except Exception as err:  # any failed build costs only speed: the reference gives the same bits
        lines = str(err).strip().splitlines()
        reason = lines[0][:160] if lines else type(err).__name__
        _log.warning("worldpipe: the compiled %s is unavailable (%s); running its Python reference (same "
                     "results, slower); `python -m worldpipe.models.native` shows the build", extension, reason)
        return None
