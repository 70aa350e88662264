"""Configs that passed the checks needing torch, remembered so later Snakefile parses skip importing torch.

Every parse of the Snakefile validates each experiment's composed config (:func:`worldpipe.trainer.validation.
validate_config`). That includes the model's constructor signature and the layout's rules, and both import torch,
which every `snakemake` call (a dry run, a summary, each SLURM job's own parse) would pay. Those two checks depend
only on the config, the world size and the code that defines the model and layout. So a pass is recorded under a
hash of exactly that: the config's canonical JSON, the world size, the content of every source file of the
installed worldpipe package, and the torch version. Editing any of these gives a new key, and the checks run
again. A failure is never recorded: it is reported at every parse, as before.

Only models of worldpipe's own package are remembered, because the fingerprint covers their source and nothing
outside it. The launcher never uses this cache: it imports torch anyway. A cache it cannot read or write just
means the checks run.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path

from worldpipe.core.atomic import write_atomic
from worldpipe.core.hashing import canonical_hash

PACKAGE = "worldpipe"
PACKAGE_DIR = Path(__file__).resolve().parent.parent
# Source the verdict depends on: the Python of the package (model classes, layout rules, the checks themselves).
SOURCE_SUFFIXES = (".py",)


def cache_dir() -> Path:
    """Where passes are recorded: ``$XDG_CACHE_HOME/worldpipe/validated`` (default ``~/.cache/...``)."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / PACKAGE / "validated"


@functools.cache
def source_fingerprint() -> str:
    """SHA-256 over the relative path and bytes of every source file of the worldpipe package, and torch's version."""
    digest = hashlib.sha256()
    for path in sorted(p for p in PACKAGE_DIR.rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file()):
        digest.update(str(path.relative_to(PACKAGE_DIR)).encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    with contextlib.suppress(metadata.PackageNotFoundError):
        digest.update(f"torch=={metadata.version('torch')}".encode())
    return digest.hexdigest()


def verdict_key(config: Mapping, world_size: int) -> str | None:
    """The key a pass of ``config`` at ``world_size`` is recorded under; None where it cannot be remembered."""
    target = str((config.get("model") or {}).get("_target_") or "")
    if not target.startswith(PACKAGE + "."):
        return None
    try:
        return canonical_hash({"config": config, "world_size": world_size, "code": source_fingerprint()})
    except (TypeError, ValueError, OSError):  # a value JSON cannot spell, an unreadable source file
        return None


def passed_before(key: str | None) -> bool:
    """Whether the config of ``key`` passed the checks with this code before."""
    return key is not None and (cache_dir() / key).is_file()


def record_pass(key: str | None) -> None:
    """Remember that the config of ``key`` passed (atomically; silently not where the cache cannot be written)."""
    if key is None:
        return
    with contextlib.suppress(OSError):
        cache_dir().mkdir(parents=True, exist_ok=True)
        write_atomic(cache_dir() / key, b"")
