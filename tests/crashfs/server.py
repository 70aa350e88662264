"""The crash-simulating file system served over FUSE (libfuse3 through mfusepy): ``python -m crashfs.server``.

It serves the :class:`crashfs.model.Model` of ``--backing`` (a plain directory: the disk) at ``--mount``. A clean
unmount writes everything back to the backing directory (an unmount syncs); a power cut (``cut`` on the control
socket, or ``--cut-after N``: right after the N-th persistence point) writes back only what is durable, and from
then on every operation fails with EIO, as a disk without power would. The control socket
(``multiprocessing.connection``, ``--control``) takes ``("faults", {...})``, ``("cut",)``, ``("recording",)``
and ``("points",)``; the recording (initial image and operation log) is also written to ``--state``/recording.pickle
at every unmount and cut. The test fixture that starts and stops it is :mod:`crashfs.mount`.
"""

from __future__ import annotations

import argparse
import errno
import os
import pickle
import shutil
import sys
import threading
from multiprocessing.connection import Listener
from pathlib import Path

import mfusepy as fuse

from .model import FsError, Model, is_persistence_point, mode_of, read_image, write_image

BLOCK = 4096
# What statfs reports as the size of the disk when no ENOSPC budget is armed.
NOMINAL_BLOCKS = 1 << 24


def _rel(path: str | None) -> str:
    return (path or "/").strip("/")


class CrashFs(fuse.Operations):
    """FUSE operations over a Model: every change goes through ``Model.apply`` and is logged."""

    use_ns = True

    def __init__(self, model: Model, backing: Path, state: Path, cut_after: int | None) -> None:
        self.model, self.backing, self.state = model, backing, state
        self.initial = model.volatile_image()
        self.guard = threading.RLock()
        self.cut_after = cut_after
        self.points = 0
        self.cut_done = False

    # ------------------------------------------------------------------ helpers

    def _apply(self, op: tuple) -> object:
        with self.guard:
            try:
                result = self.model.apply(op)
            except FsError as exc:
                raise fuse.FuseOSError(exc.errno) from None
            if is_persistence_point(op):
                self.points += 1
                if self.cut_after is not None and self.points >= self.cut_after:
                    self.cut()
            return result

    def _node(self, path: str, fh: int | None = None):
        with self.guard:
            try:
                if fh is not None and fh in self.model.handles:
                    return self.model.handles[fh]
                return self.model.lookup(_rel(path))
            except FsError as exc:
                raise fuse.FuseOSError(exc.errno) from None

    def _new_fh(self) -> int:
        with self.guard:
            fh = self.model._next_fh
            self.model._next_fh += 1
            return fh

    def save_recording(self) -> None:
        """Write the initial image and the operation log to the state directory (atomically: the reader is the
        test, which may read it while this process is being stopped)."""
        tmp = self.state / "recording.pickle.tmp"
        tmp.write_bytes(pickle.dumps({"initial": self.initial, "log": self.model.log}, protocol=5))
        os.replace(tmp, self.state / "recording.pickle")

    def _write_backing(self, image: dict) -> None:
        fresh = self.backing.with_name(self.backing.name + ".new")
        shutil.rmtree(fresh, ignore_errors=True)
        write_image(image, fresh)
        old = self.backing.with_name(self.backing.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(self.backing, old)
        os.rename(fresh, self.backing)
        shutil.rmtree(old)

    def cut(self) -> int:
        """Power cut: keep only what is durable; from now on the disk answers nothing but EIO."""
        with self.guard:
            if not self.cut_done:
                self.cut_done = True
                self._write_backing(self.model.durable_image())
                self.model.frozen = True
                self.save_recording()
                (self.state / "cut").write_text(f"{self.points}\n")
            return self.points

    # ------------------------------------------------------------------ lifecycle

    def init(self, path: str) -> None:  # noqa: D102
        print("ready", flush=True)

    def destroy(self, path: str) -> None:  # noqa: D102
        with self.guard:
            if not self.cut_done:
                self._write_backing(self.model.volatile_image())
                self.save_recording()

    # ------------------------------------------------------------------ reading

    def getattr(self, path: str, fh: int | None = None) -> dict:  # noqa: D102
        node = self._node(path, fh)
        with self.guard:
            if self.model.frozen:
                raise fuse.FuseOSError(errno.EIO)
            ns = int(node.mtime * 1e9)
            return {"st_mode": mode_of(node), "st_nlink": 2 if node.kind == "d" else 1, "st_size": node.size,
                    "st_uid": os.getuid(), "st_gid": os.getgid(), "st_ino": node.ino,
                    "st_atime": ns, "st_mtime": ns, "st_ctime": ns, "st_blocks": (node.size + 511) // 512,
                    "st_blksize": BLOCK}

    def readdir(self, path: str, fh: int) -> list[str]:  # noqa: D102
        node = self._node(path)
        with self.guard:
            if self.model.frozen:
                raise fuse.FuseOSError(errno.EIO)
            return [".", "..", *node.names]

    def readlink(self, path: str) -> str:  # noqa: D102
        node = self._node(path)
        if node.kind != "l":
            raise fuse.FuseOSError(errno.EINVAL)
        return node.target

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:  # noqa: D102
        node = self._node(path, fh)
        with self.guard:
            if self.model.frozen:
                raise fuse.FuseOSError(errno.EIO)
            return bytes(node.data[offset:offset + size])

    def statfs(self, path: str) -> dict:  # noqa: D102
        with self.guard:
            space = self.model.faults.space
            free = NOMINAL_BLOCKS if space is None else max(space, 0) // BLOCK
            return {"f_bsize": BLOCK, "f_frsize": BLOCK, "f_blocks": max(free, NOMINAL_BLOCKS), "f_bfree": free,
                    "f_bavail": free, "f_files": 1 << 20, "f_ffree": 1 << 20, "f_favail": 1 << 20,
                    "f_namemax": 255}

    def access(self, path: str, amode: int) -> int:  # noqa: D102
        self._node(path)
        return 0

    # ------------------------------------------------------------------ handles

    def open(self, path: str, flags: int) -> int:  # noqa: D102
        fh = self._new_fh()
        self._apply(("open", _rel(path), fh))
        if flags & os.O_TRUNC:
            self._apply(("truncate", None, fh, 0))
        return fh

    def create(self, path: str, mode: int, fi=None) -> int:  # noqa: D102
        fh = self._new_fh()
        self._apply(("create", _rel(path), mode, fh))
        return fh

    def release(self, path: str, fh: int) -> int:  # noqa: D102
        with self.guard:
            if not self.model.frozen:
                self.model.apply(("release", fh))
        return 0

    def flush(self, path: str, fh: int) -> int:  # noqa: D102
        return 0

    def opendir(self, path: str) -> int:  # noqa: D102
        node = self._node(path)
        if node.kind != "d":
            raise fuse.FuseOSError(errno.ENOTDIR)
        return 0

    def releasedir(self, path: str, fh: int) -> int:  # noqa: D102
        return 0

    # ------------------------------------------------------------------ changes

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:  # noqa: D102
        return self._apply(("write", fh, offset, bytes(data)))

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:  # noqa: D102
        self._apply(("truncate", _rel(path) if fh is None else None, fh, length))
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:  # noqa: D102
        self._apply(("fsync", fh, _rel(path)))
        return 0

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:  # noqa: D102
        self._apply(("fsyncdir", _rel(path)))
        return 0

    def mkdir(self, path: str, mode: int) -> int:  # noqa: D102
        self._apply(("mkdir", _rel(path), mode))
        return 0

    def rmdir(self, path: str) -> int:  # noqa: D102
        self._apply(("rmdir", _rel(path)))
        return 0

    def unlink(self, path: str) -> int:  # noqa: D102
        self._apply(("unlink", _rel(path)))
        return 0

    def rename(self, old: str, new: str) -> int:  # noqa: D102
        self._apply(("rename", _rel(old), _rel(new)))
        return 0

    def symlink(self, target: str, source: str) -> int:
        """``ln -s source target``: the link ``target`` pointing at ``source``."""
        self._apply(("symlink", _rel(target), source))
        return 0

    def link(self, target: str, source: str) -> int:
        """``ln source target``: the hard link ``target`` to the file ``source``."""
        self._apply(("link", _rel(source), _rel(target)))
        return 0

    def chmod(self, path: str, mode: int) -> int:  # noqa: D102
        self._apply(("chmod", _rel(path), mode))
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:  # noqa: D102
        return 0

    def utimens(self, path: str, times=None) -> int:  # noqa: D102
        self._node(path)
        return 0


def _serve_control(fs: CrashFs, listener: Listener) -> None:
    while True:
        with listener.accept() as conn:
            try:
                while True:
                    request = conn.recv()
                    conn.send(_answer(fs, request))
            except EOFError:
                continue


def _answer(fs: CrashFs, request: tuple) -> object:
    kind = request[0]
    if kind == "faults":
        with fs.guard:
            for key, value in request[1].items():
                setattr(fs.model.faults, key, value)
            fs.model.faults.seen_fsyncs = 0
        return True
    if kind == "cut":
        return fs.cut()
    if kind == "recording":
        with fs.guard:
            return {"initial": fs.initial, "log": list(fs.model.log)}
    if kind == "points":
        return fs.points
    if kind == "length":
        with fs.guard:
            return len(fs.model.log)
    return ValueError(f"unknown control request {request!r}")


def main(argv: list[str] | None = None) -> int:
    """Serve until unmounted (``fusermount3 -u``)."""
    parser = argparse.ArgumentParser(prog="crashfs")
    parser.add_argument("--backing", required=True, type=Path)
    parser.add_argument("--mount", required=True)
    parser.add_argument("--state", required=True, type=Path)
    parser.add_argument("--control", required=True)
    parser.add_argument("--cut-after", type=int, default=None)
    args = parser.parse_args(argv)
    args.backing.mkdir(parents=True, exist_ok=True)
    args.state.mkdir(parents=True, exist_ok=True)
    fs = CrashFs(Model(read_image(args.backing)), args.backing, args.state, args.cut_after)
    listener = Listener(args.control, family="AF_UNIX")  # listening before the mount reports ready
    threading.Thread(target=_serve_control, args=(fs, listener), daemon=True).start()
    fuse.FUSE(fs, args.mount, foreground=True, nothreads=True, fsname="crashfs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
