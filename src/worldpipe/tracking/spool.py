"""The durable outbox of a run's records: an append-only journal in ``RUN_DIR/tracking/``.

Every record a run sends to MLflow is first appended here (one JSON line, ``fsync``; the records of one event,
such as a checkpoint's commit, artifacts and tags, with one ``fsync``), with a sequence number; files an artifact
record uploads are copied into it first (small text inline in the line, the rest into ``blobs/<seq>/``), so later
changes (retention deleting a checkpoint) cannot change what gets recorded. ``state.json`` (replaced atomically) holds the highest
acknowledged sequence number and the MLflow run id once known. Delivery (``worldpipe.tracking.delivery``)
replays records after the acknowledged one, in order, and acknowledges each after MLflow accepted it; every
record kind is applied idempotently, so a crash between applying and acknowledging duplicates nothing.

Layout::

    tracking/journal.jsonl   {"seq": n, "op": ..., "time_ms": ...} per line, append-only
    tracking/state.json      {"acked": n, "offset": bytes, "run_id": ..., "record_key": ..., ...}
    tracking/blobs/<seq>/    files of artifact record <seq> (removed once acknowledged)
    tracking/.append.lock    flock: one appender at a time (sequence numbers)
    tracking/.deliver.lock   flock: one deliverer at a time (acknowledgements in state.json)
    tracking/.active         flock held by a live training process for its whole life
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from worldpipe.core.atomic import (
    append_durably,
    fsync_dir,
    makedirs_durably,
    write_file_durably,
    write_text_atomic,
)

TRACKING_DIR = "tracking"
JOURNAL_NAME = "journal.jsonl"
STATE_NAME = "state.json"
BLOBS_DIR = "blobs"
# Artifact files of text up to this size are journaled in their record's line: no blob files, no fsync of their
# own (a checkpoint's records: manifest, digest, sampler and RNG views, a few KiB each).
INLINE_LIMIT = 1 << 16


def _record(line: bytes) -> dict | None:
    """The record of one complete journal line, or None for what a crash can leave instead: zeros (a hole where
    an unsynced write never reached the disk) or a line cut and joined to another."""
    if not line.endswith(b"\n") or b"\0" in line:
        return None
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) and isinstance(record.get("seq"), int) else None


def _valid_records(handle, offset: int, previous: int | None = None) -> list[tuple[dict, int]]:
    """The records from ``handle``'s position (byte ``offset``) up to the first line that is not one, or whose
    sequence number does not follow the one before (``previous``: the number before the first); each with the
    offset just after it. What follows such a line was never fsynced: it is never acknowledged nor delivered."""
    out = []
    for line in handle:
        record = _record(line)
        if record is None or (previous is not None and record["seq"] != previous + 1):
            break
        offset += len(line)
        previous = record["seq"]
        out.append((record, offset))
    return out


class Spool:
    """The journal, blobs and acknowledgement state of one run directory."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.dir = self.run_dir / TRACKING_DIR
        self.journal = self.dir / JOURNAL_NAME
        self.state_path = self.dir / STATE_NAME
        self._active_fd: int | None = None
        self._whole: tuple[int, int] | None = None  # (bytes, last seq) of the journal found whole by this process

    # ---- locking ----
    @contextlib.contextmanager
    def locked(self, kind: str = "deliver") -> Iterator[None]:
        """Exclusive lock: "append" orders journal writes; "deliver" guards state.json (acknowledgements).

        Separate locks let the training thread append while a delivery (network calls) is in progress.
        """
        # Durably: a power cut must not lose the directory (and every record in it) by losing its name.
        makedirs_durably(self.dir)
        fd = os.open(self.dir / f".{kind}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def hold_active(self) -> None:
        """Mark a live writer (the training process) until release_active or process exit."""
        if self._active_fd is not None:
            return
        makedirs_durably(self.dir)
        fd = os.open(self.dir / ".active", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"another process is recording into {self.dir}") from None
        self._active_fd = fd

    def release_active(self) -> None:
        if self._active_fd is not None:
            fcntl.flock(self._active_fd, fcntl.LOCK_UN)
            os.close(self._active_fd)
            self._active_fd = None

    def writer_alive(self) -> bool:
        """True while a training process holds this run directory's records."""
        path = self.dir / ".active"
        if not path.exists():
            return False
        fd = os.open(path, os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return False
        finally:
            os.close(fd)

    # ---- state ----
    def state(self) -> dict[str, Any]:
        state = {"acked": 0, "offset": 0, "run_id": None, "record_key": None, "experiment_id": None,
                 "uri": None, "rejected": [], "new_run": None}
        if self.state_path.exists():
            state.update(json.loads(self.state_path.read_text()))
        return state

    def save_state(self, state: Mapping[str, Any]) -> None:
        write_text_atomic(self.state_path, json.dumps(state, indent=1, sort_keys=True))

    def record_key(self) -> str:
        """Stable id of this run directory's record (tags the MLflow run, so creating it is idempotent)."""
        with self.locked():
            state = self.state()
            if not state["record_key"]:
                state["record_key"] = uuid.uuid4().hex
                self.save_state(state)
            return state["record_key"]

    # ---- journal ----
    def read(self, offset: int = 0) -> list[tuple[dict, int]]:
        """Complete records from byte ``offset`` on, each with the offset just after it (a torn tail is ignored)."""
        if not self.journal.exists():
            return []
        with open(self.journal, "rb") as handle:
            handle.seek(offset)
            return _valid_records(handle, offset)

    def records(self) -> list[dict]:
        return [record for record, _ in self.read()]

    def _repair_tail(self) -> int:
        """Cut what follows the last complete record (a torn line, or what a power cut left of an unsynced append:
        a hole of zeros before a part of it); returns the last complete sequence number."""
        if not self.journal.exists():
            self._whole = (0, 0)
            return 0
        size = self.journal.stat().st_size
        # Where this process last found the journal whole: only what was appended since is checked again.
        start, seq = self._whole if self._whole is not None and self._whole[0] <= size else (0, 0)
        with open(self.journal, "r+b") as handle:
            handle.seek(start)
            records = _valid_records(handle, start, seq if start else None)
            end = records[-1][1] if records else start
            if end != size:
                handle.truncate(end)
                handle.flush()
                os.fsync(handle.fileno())
        last = int(records[-1][0]["seq"]) if records else seq
        self._whole = (end, last)
        return last

    def append(self, op: str, files: Mapping[str, bytes] | None = None, **fields: Any) -> int:
        """Durably append one record (its files first); returns its sequence number."""
        return self.append_many([(op, files, fields)])[0]

    def append_many(self, entries: Sequence[tuple[str, Mapping[str, bytes] | None, Mapping[str, Any]]]) -> list[int]:
        """Durably append records (op, files, fields) in order, with one journal fsync; their sequence numbers.

        An artifact file of text up to INLINE_LIMIT bytes travels in its record's line (``inline``); a larger
        or binary one is written to ``blobs/<seq>/`` and fsynced first. A crash mid-write leaves a prefix of
        the records (a torn last line is cut by the next append), as separate appends would.
        """
        with self.locked("append"):
            first = self._repair_tail() + 1
            now = int(time.time() * 1000)
            lines = []
            for seq, (op, files, fields) in enumerate(entries, start=first):
                record, large = {"seq": seq, "op": op, "time_ms": now, **fields}, {}
                for name, data in (files or {}).items():
                    if len(data) <= INLINE_LIMIT:
                        with contextlib.suppress(UnicodeDecodeError):
                            record.setdefault("inline", {})[name] = bytes(data).decode("utf-8")
                            continue
                    large[name] = data
                if large:
                    self._write_blobs(seq, large)
                lines.append(json.dumps(record, sort_keys=True, allow_nan=True) + "\n")
            data = "".join(lines).encode()
            append_durably(self.journal, data)
            if first == 1:
                fsync_dir(self.dir)
            self._whole = (self._whole[0] + len(data), first + len(entries) - 1)
            return list(range(first, first + len(entries)))

    def _write_blobs(self, seq: int, files: Mapping[str, bytes]) -> None:
        blob = self.blob_dir(seq)
        if blob.exists():  # left by a crash between writing blobs and the journal line
            shutil.rmtree(blob)
        for relpath, data in files.items():
            target = blob / relpath
            makedirs_durably(target.parent)  # blobs/ itself may be new: the journal line will vouch for it
            write_file_durably(target, [data])
            fsync_dir(target.parent)
        fsync_dir(blob.parent)

    def blob_dir(self, seq: int) -> Path:
        return self.dir / BLOBS_DIR / f"{seq:08d}"

    def drop_blobs(self, seq: int) -> None:
        shutil.rmtree(self.blob_dir(seq), ignore_errors=True)

    def pending(self) -> list[dict]:
        """Records not yet acknowledged."""
        return [record for record, _ in self.read(self.state()["offset"])]
