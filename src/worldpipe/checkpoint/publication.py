"""The publication protocol (docs/architecture.md, "Publication protocol"): its order, once, for every store and
every save.

A store says how each step is done (:class:`.stores.base.StepWriter`: a POSIX partial directory renamed into
place, or objects committed by their manifest); this module says in which order, with the fault phases of
:mod:`.fault` between the steps:

1. ``begin`` (the committing process, holding the store's writer lock): remove what interrupted saves left, make
   the step's place (``before_files``);
2. ``write`` (every process that writes files of the step): each file written and hashed meanwhile
   (``mid_files`` after this process's first), its record handed on only once it is durable;
3. ``commit`` (the committing process, with every process's records): the files' names made durable
   (``after_files``), ``MANIFEST.json`` last (``after_manifest``), the commit that shows the step to readers
   (``after_rename``), then ``latest`` (``after_latest``).

A failure before the commit discards the step: the previous checkpoint stays ``latest``. A full save runs all of
it in one process (:func:`publish`); a sharded save (:mod:`.sharded_saver`) splits it across ranks: rank 0 begins
and commits, every rank writes its own pieces in between. Retention (the manager's) follows either.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from concurrent.futures import Future, wait

from . import fault, layout
from .codec import PendingFile
from .errors import CheckpointWriteError
from .manifest import FileRecord, build_manifest, hash_pool, sha256_segments
from .stores.base import Store

logger = logging.getLogger("worldpipe.checkpoint")


class Publication:
    """One step on its way into a store; every process that writes files of the step holds one."""

    def __init__(self, store: Store, step: int, token: str | None = None) -> None:
        """``token`` None: the committing process's publication (see :meth:`begin`); otherwise another process's,
        writing into the step the committing one began (``token``: its writer's)."""
        self.store, self.step, self.writer = store, step, store.step_writer(step, token)
        self._written = 0  # files this process has written (``mid_files`` fires after its first)

    @classmethod
    def begin(cls, store: Store, step: int) -> Publication:
        """The committing process, holding ``store.writer_lock(step)``: clear leftovers, make the step's place."""
        try:
            removed = store.remove_leftovers()
        except OSError as exc:
            raise CheckpointWriteError(step, store.url, f"cannot remove leftovers: {exc}") from exc
        for path in removed:
            logger.warning("removed leftover of an interrupted save or deletion: %s", path)
        publication = cls(store, step)
        try:
            fault.inject("before_files")
            publication.writer.create()
        except OSError as exc:
            publication.writer.discard()
            raise CheckpointWriteError(step, publication.writer.path(), exc) from exc
        return publication

    def write(self, files: list[PendingFile]) -> list[FileRecord]:
        """Write this process's ``files`` of the step; their manifest records once every one is durable.

        An I/O failure raises CheckpointWriteError naming the file; what becomes of the step is the committing
        process's call.
        """
        # Hash the same bytes on other threads while this one writes them (hashlib drops the GIL). Largest
        # first: the longest hash starts at once instead of becoming a serial tail after the writes.
        digests = {f.relpath: hash_pool().submit(sha256_segments, f.segments)
                   for f in sorted(files, key=lambda f: f.size, reverse=True)}
        durable: list[tuple[str, Future]] = []
        where = self.writer.path()
        try:
            for pending in files:
                where = self.writer.path(pending.relpath)
                durable.append((where, self.writer.write(pending.relpath, pending.segments)))
                self._written += 1
                if self._written == 1:
                    fault.inject("mid_files")
        except OSError as exc:
            raise CheckpointWriteError(self.step, where, exc) from exc
        finally:
            wait([done for _, done in durable])  # every descriptor closed before any error propagates
        failed = [(where, done.exception()) for where, done in durable if done.exception() is not None]
        if failed:
            raise CheckpointWriteError(self.step, *failed[0]) from failed[0][1]
        return [FileRecord(f.relpath, f.size, digests[f.relpath].result()) for f in files]

    def commit(self, records: Iterable[FileRecord], contents: Mapping, identity: Mapping,
               tensors: list[dict] | None) -> None:
        """The committing process, with the records of every file of the step (every one durable): manifest last,
        the commit, ``latest``. A failure before the commit discards the step; one after it keeps the step."""
        records = list(records)
        where = self.writer.path()
        try:
            self.writer.seal(r.path for r in records)
            fault.inject("after_files")
            where = self.writer.path(layout.MANIFEST_NAME)
            self.writer.stage_manifest(build_manifest(self.step, records, contents, identity, tensors))
            where = self.writer.path()
            fault.inject("after_manifest")
            where = self.store.location(self.step)
            self.writer.commit()
        except BaseException as exc:
            self.writer.discard()
            if isinstance(exc, OSError):
                raise CheckpointWriteError(self.step, where, exc) from exc
            raise
        try:
            fault.inject("after_rename")
            self.store.write_latest(layout.step_dir_name(self.step))
            fault.inject("after_latest")
        except OSError as exc:
            raise CheckpointWriteError(self.step, f"{self.store.url}/{layout.LATEST_NAME}", exc) from exc


def publish(store: Store, step: int, files: list[PendingFile], contents: Mapping, identity: Mapping,
            tensors: list[dict] | None = None) -> None:
    """A full save: the whole protocol in this process (the caller holds ``store.writer_lock(step)``)."""
    publication = Publication.begin(store, step)
    try:
        records = publication.write(files)
    except BaseException:
        publication.writer.discard()
        raise
    publication.commit(records, contents, identity, tensors)
