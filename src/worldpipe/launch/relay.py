"""Relay of torchrun's stderr to the user: everything passes except what would bury the one error line.

Workers print an error as one line (:mod:`worldpipe.core.errors`); torchrun adds its own report of the failed child
(a ``ChildFailedError`` traceback, "closing signal" warnings) and every other rank adds its secondary error
("Connection closed by peer"). The relay prints the first primary error line, a secondary one only when no
rank reported a primary error, neither on stderr nor in its last words (a rank whose stderr failed:
:mod:`worldpipe.core.last_words`); after a failure, everything it held back goes to the run's log file. In
debug mode everything passes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from worldpipe.core.errors import ERROR_PREFIX, SECONDARY_PREFIX

# torchrun's own log lines (glog-style prefix, e.g. "W1129 18:50:01.123000 1234 torch/distributed/...").
_AGENT_LINE = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ .*torch/distributed/")
_CHILD_EXIT = re.compile(r"failed \(exitcode: (-?\d+)\)")
_TRACEBACK = "Traceback (most recent call last):"


class OutputRelay:
    """Feed it torchrun's stderr bytes; it writes what the user should see to ``out``, the rest to ``log_file``."""

    def __init__(self, out: IO[str], log_file: Path, debug: bool = False) -> None:
        self.out, self.log_file, self.debug = out, log_file, debug
        self.primary: str | None = None
        self.secondary: str | None = None
        self.child_exit: int | None = None
        self.last_held: str | None = None
        self._held: list[str] = []
        self._in_traceback = False
        self._at_line_start = True  # whether the console's current line is empty (a bar ends with '\r')
        self._partial = b""

    def feed(self, data: bytes) -> None:
        """Process a chunk; lines end at '\\n' or '\\r' (progress bars redraw with '\\r')."""
        self._partial += data
        while True:
            cut = max(self._partial.rfind(b"\n"), self._partial.rfind(b"\r"))
            if cut < 0:
                return
            complete, self._partial = self._partial[:cut + 1], self._partial[cut + 1:]
            for piece in re.split(rb"(?<=[\r\n])", complete):
                if piece:
                    self._line(piece.decode(errors="replace"))

    def pump(self, fd: int) -> None:
        """Relay from ``fd`` until end of file (signals interrupt and resume the read)."""
        while chunk := os.read(fd, 65536):
            self.feed(chunk)
        self.close()

    def close(self) -> None:
        """Flush a trailing partial line."""
        if self._partial:
            self._line(self._partial.decode(errors="replace"))
            self._partial = b""
        self.out.flush()

    def write_log(self) -> None:
        """Append what was held back from the console to the log file (after a failure)."""
        if self._held:
            try:
                self.log_file.parent.mkdir(parents=True, exist_ok=True)
                with open(self.log_file, "a", encoding="utf-8") as f:
                    f.write("--- torchrun output held back from the console\n" + "".join(self._held) + "\n")
            except OSError:
                pass
            self._held = []

    def _line(self, line: str) -> None:
        if line == "\r" and self._at_line_start:
            return  # a carriage return at the start of an empty line (before an error line): nothing to redraw
        text = line.rstrip("\r\n")
        exit_match = _CHILD_EXIT.search(text)
        if exit_match and self.child_exit is None:
            self.child_exit = int(exit_match.group(1))
        if self.debug:
            self._write(line)
            return
        if text.startswith(SECONDARY_PREFIX):
            self.secondary = self.secondary or text
            self._hold(line)
        elif text.startswith(ERROR_PREFIX) and not self._in_traceback:
            if self.primary is None:
                self.primary = text
                self._write(("" if self._at_line_start else "\n") + text + "\n")
                self.out.flush()
            else:
                self._hold(line)
        elif self._in_traceback or text.startswith(_TRACEBACK):
            # Workers never print tracebacks (they print one line); this is torchrun's report of the failure.
            self._in_traceback = True
            self._hold(line)
        elif _AGENT_LINE.match(text):
            self._hold(line)
        else:
            self._write(line)

    @property
    def at_line_start(self) -> bool:
        """Whether the console's current line is empty (what was written last ended with a newline)."""
        return self._at_line_start

    def _write(self, text: str) -> None:
        self.out.write(text)
        self._at_line_start = text.endswith("\n")

    def _hold(self, line: str) -> None:
        self._held.append(line if line.endswith(("\n", "\r")) else line + "\n")
        if line.strip():
            self.last_held = line.strip()

    def summary(self, returncode: int, last_words: Sequence[str] = ()) -> str | None:
        """The one line to print after a failed torchrun when no primary error line was shown.

        ``last_words``: the lines the ranks left beside stderr (:mod:`worldpipe.core.last_words`); a primary
        one among them is the cause even when its rank could not print it (its stderr failed).
        """
        if returncode == 0 or self.primary is not None or self.debug:
            return None
        primary = next((line for line in last_words if line.startswith(ERROR_PREFIX)), None)
        if primary is not None:
            return primary
        if self.secondary is not None:
            return ERROR_PREFIX + self.secondary.removeprefix(SECONDARY_PREFIX)
        detail = f": {self.last_held}" if self.last_held else ""
        return f"{ERROR_PREFIX}training failed (torchrun exit status {returncode}){detail}; details in {self.log_file}"
