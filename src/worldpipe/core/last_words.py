"""A worker's last words: its one error line, kept where the launcher finds it even when stderr fails.

A rank whose disk fails may find its stderr failing too (an injected EIO on every ``write``, a pipe gone): its
error line never reaches the launcher's relay, and the other ranks' secondary "Connection closed by peer"
would stand in for the cause. So before torchrun starts, the launcher creates one zero-filled page per local
rank in a node-local temporary directory (``WORLDPIPE_LAST_WORDS``); each worker maps its page at start-up and,
on failure, copies its line into the mapping: no system call, so nothing can fail. After torchrun has exited,
the launcher reads the pages when no primary error line arrived on stderr
(:meth:`worldpipe.launch.relay.OutputRelay.summary`).
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
from pathlib import Path

ENV_VAR = "WORLDPIPE_LAST_WORDS"
PAGE = 4096


def _page_file(directory: Path, local_rank: int) -> Path:
    return directory / f"rank-{local_rank:05d}"


class LastWords:
    """The launcher's side: one page per local rank, read after torchrun has exited, removed with the directory."""

    def __init__(self, nproc: int) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="worldpipe-last-words-"))
        for local_rank in range(nproc):
            with open(_page_file(self.dir, local_rank), "wb") as f:
                f.truncate(PAGE)

    def read(self) -> list[str]:
        """The lines the ranks left, in local-rank order (empty pages skipped)."""
        lines = []
        for page in sorted(self.dir.glob("rank-*")):
            text = page.read_bytes().split(b"\0", 1)[0].decode(errors="replace").strip()
            if text:
                lines.append(text)
        return lines

    def remove(self) -> None:
        """Delete the pages (the workers have exited: nothing maps them any more)."""
        shutil.rmtree(self.dir, ignore_errors=True)


class LastWordsPage:
    """The worker's side: its mapped page (absent without ``WORLDPIPE_LAST_WORDS``: a run without the launcher)."""

    def __init__(self) -> None:
        self._map: mmap.mmap | None = None
        directory = os.environ.get(ENV_VAR)
        if not directory:
            return
        try:
            fd = os.open(_page_file(Path(directory), int(os.environ.get("LOCAL_RANK", "0"))), os.O_RDWR)
        except (OSError, ValueError):
            return  # best effort: stderr still carries the line
        try:
            self._map = mmap.mmap(fd, PAGE)
        except OSError:
            pass
        finally:
            os.close(fd)

    def record(self, line: str) -> None:
        """Leave ``line`` for the launcher (a memory copy into the shared page, NUL-terminated)."""
        if self._map is not None:
            data = line.encode(errors="replace")[: PAGE - 1]
            self._map[: len(data) + 1] = data + b"\0"
