"""The crash-simulating file system's model: what a process sees now, and what a power cut would leave.

Every file has volatile data (what reads return) and durable data (what survives a power cut); every directory has
volatile names and durable names. The fault model (docs/durability.md):

* a file's data becomes durable at its ``fsync``/``fdatasync`` (the whole file as it is then);
* a directory's names (create, rename, link, unlink, symlink, mkdir, rmdir) become durable at that directory's ``fsync``;
* a cut keeps only what is durable, and may tear the last write that was not yet durable: a prefix of it, cut at a
  512 B or 4 KiB boundary of the file, or all of it, reaches the disk without the unsynced writes before it;
* it may also persist names before data (a journal that commits a rename ahead of the file's pages: the "eager
  names" crash state), never data that was not written.

Every operation is applied through :meth:`Model.apply` and appended to :attr:`Model.log`, so a recorded run can be
replayed on a fresh model from the same initial image, and the crash state after each operation computed
(:func:`crash_states`). The model knows nothing of FUSE: :mod:`crashfs.server` serves it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

SECTOR_SIZES = (512, 4096)

# An image: relative path -> ("d",) | ("f", bytes) | ("l", target). The root is "".
Image = dict[str, tuple]


@dataclass(eq=False)
class Node:
    """One inode: a directory, a regular file or a symlink."""

    ino: int
    kind: str  # "d", "f", "l"
    mode: int
    data: bytearray = field(default_factory=bytearray)  # volatile contents (files)
    durable: bytes = b""  # contents a power cut keeps (files)
    target: str = ""  # symlinks
    names: dict[str, Node] = field(default_factory=dict)  # volatile entries (directories)
    durable_names: dict[str, Node] = field(default_factory=dict)  # entries a power cut keeps (directories)
    mtime: float = field(default_factory=time.time)
    parent: Node | None = None  # volatile parent (directories), for ".."

    @property
    def size(self) -> int:
        return len(self.data) if self.kind == "f" else (len(self.target) if self.kind == "l" else 4096)


class FsError(OSError):
    """An error the file system returns to the caller (its errno)."""

    def __init__(self, code: int, where: str = "") -> None:
        super().__init__(code, os.strerror(code), where or None)


@dataclass
class Faults:
    """Faults on command: ENOSPC once ``space`` more bytes were written; EIO from the ``eio_fsync``-th file fsync
    whose path contains ``eio_match`` (1-based; 0: none)."""

    space: int | None = None
    eio_fsync: int = 0
    eio_match: str = ""
    seen_fsyncs: int = 0


class Model:
    """The volatile and durable state of one mounted file system, and the log of what changed it."""

    def __init__(self, image: Image | None = None) -> None:
        self._next_ino = 1
        self.root = self._new("d", 0o755)
        self.log: list[tuple] = []
        self.faults = Faults()
        self.frozen = False  # after a live cut: every operation fails as a dead disk would
        self.handles: dict[int, Node] = {}
        self._next_fh = 1
        if image:
            self._load(image)

    # ---------------------------------------------------------------- building

    def _new(self, kind: str, mode: int) -> Node:
        node = Node(self._next_ino, kind, mode)
        self._next_ino += 1
        return node

    def _load(self, image: Image) -> None:
        """Start from ``image``, all of it durable (what the previous mount left on disk)."""
        for rel in sorted(image, key=lambda p: (p.count("/"), p)):
            if rel == "":
                continue
            parent_rel, _, name = rel.rpartition("/")
            parent = self.lookup(parent_rel)
            entry = image[rel]
            node = self._new(entry[0], 0o755 if entry[0] == "d" else 0o644)
            if entry[0] == "f":
                node.data, node.durable = bytearray(entry[1]), bytes(entry[1])
            elif entry[0] == "l":
                node.target = entry[1]
            else:
                node.parent = parent
            parent.names[name] = parent.durable_names[name] = node

    # ---------------------------------------------------------------- lookups

    def lookup(self, rel: str) -> Node:
        """The node at ``rel`` (relative to the root, "/"-separated) in the volatile tree; ENOENT if absent."""
        node = self.root
        for part in [p for p in rel.split("/") if p]:
            if node.kind != "d":
                raise FsError(errno.ENOTDIR, rel)
            if part not in node.names:
                raise FsError(errno.ENOENT, rel)
            node = node.names[part]
        return node

    def _parent(self, rel: str) -> tuple[Node, str]:
        parent_rel, _, name = rel.strip("/").rpartition("/")
        parent = self.lookup(parent_rel)
        if parent.kind != "d":
            raise FsError(errno.ENOTDIR, rel)
        return parent, name

    def handle(self, fh: int) -> Node:
        """The node an open file handle refers to (it outlives an unlink of its name)."""
        try:
            return self.handles[fh]
        except KeyError:
            raise FsError(errno.EBADF) from None

    # ---------------------------------------------------------------- operations

    def apply(self, op: tuple) -> object:
        """Apply one operation, log it, return its result (raises FsError as the file system would)."""
        if self.frozen:
            raise FsError(errno.EIO, "the disk lost power")
        result = getattr(self, "_op_" + op[0])(*op[1:])
        if op[0] == "write" and result < len(op[3]):
            op = (*op[:3], op[3][:result])  # what reached the file of a short write
        self.log.append(op)
        return result

    def _op_open(self, rel: str, fh: int) -> None:
        self.handles[fh] = self.lookup(rel)

    def _op_release(self, fh: int) -> None:
        self.handles.pop(fh, None)

    def _op_create(self, rel: str, mode: int, fh: int) -> None:
        parent, name = self._parent(rel)
        if name in parent.names:
            node = parent.names[name]
        else:
            node = self._new("f", mode & 0o7777)
            parent.names[name] = node
            parent.mtime = time.time()
        self.handles[fh] = node

    def _op_mkdir(self, rel: str, mode: int) -> None:
        parent, name = self._parent(rel)
        if name in parent.names:
            raise FsError(errno.EEXIST, rel)
        node = self._new("d", mode & 0o7777)
        node.parent = parent
        parent.names[name] = node

    def _op_symlink(self, rel: str, target: str) -> None:
        parent, name = self._parent(rel)
        if name in parent.names:
            raise FsError(errno.EEXIST, rel)
        node = self._new("l", 0o777)
        node.target = target
        parent.names[name] = node

    def _op_unlink(self, rel: str) -> None:
        parent, name = self._parent(rel)
        node = parent.names.get(name)
        if node is None:
            raise FsError(errno.ENOENT, rel)
        if node.kind == "d":
            raise FsError(errno.EISDIR, rel)
        del parent.names[name]

    def _op_rmdir(self, rel: str) -> None:
        parent, name = self._parent(rel)
        node = parent.names.get(name)
        if node is None:
            raise FsError(errno.ENOENT, rel)
        if node.kind != "d":
            raise FsError(errno.ENOTDIR, rel)
        if node.names:
            raise FsError(errno.ENOTEMPTY, rel)
        del parent.names[name]

    def _op_rename(self, old: str, new: str) -> None:
        old_parent, old_name = self._parent(old)
        new_parent, new_name = self._parent(new)
        node = old_parent.names.get(old_name)
        if node is None:
            raise FsError(errno.ENOENT, old)
        existing = new_parent.names.get(new_name)
        if existing is node:
            return
        if existing is not None:
            if existing.kind == "d" and node.kind != "d":
                raise FsError(errno.EISDIR, new)
            if existing.kind != "d" and node.kind == "d":
                raise FsError(errno.ENOTDIR, new)
            if existing.kind == "d" and existing.names:
                raise FsError(errno.ENOTEMPTY, new)
        del old_parent.names[old_name]
        new_parent.names[new_name] = node
        if node.kind == "d":
            node.parent = new_parent

    def _op_link(self, existing: str, new: str) -> None:
        node = self.lookup(existing)
        if node.kind == "d":
            raise FsError(errno.EPERM, existing)
        parent, name = self._parent(new)
        if name in parent.names:
            raise FsError(errno.EEXIST, new)
        parent.names[name] = node

    def _op_write(self, fh: int, offset: int, data: bytes) -> int:
        node = self.handle(fh)
        if self.faults.space is not None:
            if self.faults.space <= 0:
                raise FsError(errno.ENOSPC)
            data = data[: self.faults.space]  # a short write, then ENOSPC on the next
            self.faults.space -= len(data)
        end = offset + len(data)
        if end > len(node.data):
            node.data.extend(bytes(end - len(node.data)))
        node.data[offset:end] = data
        node.mtime = time.time()
        return len(data)

    def _op_truncate(self, rel: str | None, fh: int | None, length: int) -> None:
        node = self.handle(fh) if fh is not None else self.lookup(rel or "")
        if node.kind != "f":
            raise FsError(errno.EISDIR, rel or "")
        if length < len(node.data):
            del node.data[length:]
        else:
            node.data.extend(bytes(length - len(node.data)))
        node.mtime = time.time()

    def _op_fsync(self, fh: int, rel: str) -> None:
        node = self.handle(fh)
        faults = self.faults
        if faults.eio_fsync and faults.eio_match in rel:
            faults.seen_fsyncs += 1
            if faults.seen_fsyncs == faults.eio_fsync:
                self._op_fsync_eio(fh, rel)
                self.log.append(("fsync_eio", fh, rel))
                raise FsError(errno.EIO, rel)
        if node.kind == "f":
            node.durable = bytes(node.data)

    def _op_fsync_eio(self, fh: int, rel: str) -> None:
        # Linux after a failed writeback: the dirty pages are dropped (marked clean, then evicted), so the data is
        # gone and a later fsync of the file reports success for nothing.
        node = self.handle(fh)
        node.data = bytearray(node.durable)

    def _op_fsyncdir(self, rel: str) -> None:
        node = self.lookup(rel)
        node.durable_names = dict(node.names)

    def _op_chmod(self, rel: str, mode: int) -> None:
        self.lookup(rel).mode = mode & 0o7777

    # ---------------------------------------------------------------- what survives

    def durable_image(self) -> Image:
        """What a power cut now leaves: durable names, and each reachable file's durable data."""
        return self._image(durable_names=True, durable_data=True)

    def eager_names_image(self) -> Image:
        """A cut where every name change reached the disk but no data beyond what was fsynced."""
        return self._image(durable_names=False, durable_data=True)

    def volatile_image(self) -> Image:
        """Everything as a reader sees it now (what a clean unmount, which syncs, leaves)."""
        return self._image(durable_names=False, durable_data=False)

    def _image(self, durable_names: bool, durable_data: bool) -> Image:
        """The tree from the root: each directory's durable or current names, each file's durable or current data."""
        image: Image = {"": ("d",)}

        def walk(node: Node, prefix: str) -> None:
            for name, child in (node.durable_names if durable_names else node.names).items():
                rel = f"{prefix}{name}"
                if child.kind == "d":
                    image[rel] = ("d",)
                    walk(child, rel + "/")
                elif child.kind == "f":
                    image[rel] = ("f", child.durable if durable_data else bytes(child.data))
                else:
                    image[rel] = ("l", child.target)

        walk(self.root, "")
        return image

    def durable_paths_of(self, node: Node) -> list[str]:
        """Durable paths by which ``node`` is reachable (a torn write reaches the disk only through one)."""
        found = []

        def walk(at: Node, prefix: str) -> None:
            for name, child in at.durable_names.items():
                if child is node:
                    found.append(prefix + name)
                elif child.kind == "d":
                    walk(child, prefix + name + "/")

        walk(self.root, "")
        return found


# -------------------------------------------------------------------- images on disk


def read_image(root: str | os.PathLike) -> Image:
    """The image of a plain directory tree (symlinks not followed)."""
    root = Path(root)
    image: Image = {"": ("d",)}
    for dirpath, dirnames, filenames in os.walk(root):
        base = Path(dirpath).relative_to(root).as_posix()
        base = "" if base == "." else base + "/"
        for name in list(dirnames):
            full = Path(dirpath, name)
            if full.is_symlink():
                image[base + name] = ("l", os.readlink(full))
                dirnames.remove(name)
            else:
                image[base + name] = ("d",)
        for name in filenames:
            full = Path(dirpath, name)
            image[base + name] = ("l", os.readlink(full)) if full.is_symlink() else ("f", full.read_bytes())
    return image


def write_image(image: Image, root: str | os.PathLike) -> None:
    """Materialise ``image`` under the (empty or absent) directory ``root``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for rel in sorted(image, key=lambda p: (p.count("/"), p)):
        if rel == "":
            continue
        entry, path = image[rel], root / rel
        if entry[0] == "d":
            path.mkdir()
        elif entry[0] == "f":
            path.write_bytes(entry[1])
        else:
            os.symlink(entry[1], path)


def image_key(image: Image) -> str:
    """A digest of an image: equal images, equal keys (distinct crash states are counted by it)."""
    digest = hashlib.sha256()
    for rel in sorted(image):
        entry = image[rel]
        digest.update(rel.encode() + b"\0" + entry[0].encode() + b"\0")
        if entry[0] != "d":
            payload = entry[1] if isinstance(entry[1], bytes) else entry[1].encode()
            digest.update(hashlib.sha256(payload).digest())
    return digest.hexdigest()


# -------------------------------------------------------------------- replay


@dataclass(frozen=True)
class CrashState:
    """One state a power cut can leave, of a given ``kind`` ("durable", "eager-names" or "torn-<bytes>"), first
    reached after operation ``index`` of the log. ``done``: the latest cut that leaves it, as the number of
    operations that completed before it (a durable state lasts until the next persistence point), so everything
    a workload saw return by then must be in it."""

    index: int
    kind: str
    done: int
    image: Image
    key: str


def is_persistence_point(op: tuple) -> bool:
    """An fsync, fdatasync or directory fsync: the only operations that change what a cut keeps."""
    return op[0] in ("fsync", "fsyncdir")


MAX_TEARS = 64  # torn variants of one write at most (a long write's 4 KiB boundaries are then sampled evenly)


def _torn_prefixes(offset: int, length: int) -> list[int]:
    """Lengths of the prefixes of a write at ``offset`` that a cut mid-write can leave: those ending on a 4 KiB
    boundary of the file (at most MAX_TEARS, evenly spaced), the first and last ending on a 512 B one, and the
    whole write (persisted while an earlier unsynced write to the file was not: writes reordered between
    flushes)."""
    ends = {length}
    for sector in SECTOR_SIZES:
        first = (offset // sector + 1) * sector
        last = ((offset + length - 1) // sector) * sector
        ends.update(end - offset for end in (first, last) if offset < end < offset + length)
    pages = list(range((offset // 4096 + 1) * 4096, offset + length, 4096))
    if len(pages) > MAX_TEARS:
        pages = [pages[i * len(pages) // MAX_TEARS] for i in range(MAX_TEARS)]
    ends.update(end - offset for end in pages)
    return sorted(ends)


def crash_states(initial: Image, log: list[tuple], torn: bool = True, eager: bool = True) -> list[CrashState]:
    """Replay ``log`` on a model of ``initial``: every distinct state a power cut could leave, in log order. The
    durable state after each persistence point; where a write follows, that write torn at each boundary on top of
    what is durable; after each name change, the eager-names state. A state reached by several cuts is listed
    once, with the latest of them (``done``)."""
    model = Model(initial)
    found: dict[str, CrashState] = {}
    pending: Image | None = None  # the durable image since the last persistence point
    pending_index = -1

    def add(index: int, kind: str, done: int, image: Image) -> None:
        key = image_key(image)
        old = found.get(key)
        if old is None:
            found[key] = CrashState(index, kind, done, image, key)
        elif done > old.done or (kind == "durable" and old.kind != "durable"):
            # Named by its plainest kind: a durable state that an eager or torn cut also reaches is durable.
            found[key] = CrashState(old.index, "durable" if kind == "durable" else old.kind,
                                    max(done, old.done), image, key)

    pending = model.durable_image()
    for index, op in enumerate(log):
        if is_persistence_point(op):
            add(pending_index, "durable", index, pending)  # cut just before this point
        with contextlib.suppress(FsError):  # one that failed when recorded fails again: nothing changed
            model.apply(op)
        if is_persistence_point(op):
            pending, pending_index = model.durable_image(), index
        elif op[0] == "write" and torn:
            node = model.handles.get(op[1])
            paths = model.durable_paths_of(node) if node is not None else []
            if paths:
                _, offset, data = op[1:]
                for cut in _torn_prefixes(offset, len(data)):
                    image = model.durable_image()
                    old = bytearray(node.durable)
                    end = offset + cut
                    if end > len(old):
                        old.extend(bytes(end - len(old)))
                    old[offset:end] = data[:cut]
                    for path in paths:
                        image[path] = ("f", bytes(old))
                    add(index, f"torn-{cut}", index + 1, image)
        elif eager and op[0] in ("create", "mkdir", "symlink", "link", "unlink", "rmdir", "rename"):
            add(index, "eager-names", index + 1, model.eager_names_image())
    add(pending_index, "durable", len(log), pending)
    return sorted(found.values(), key=lambda state: (state.index, state.done))


def durable_after(initial: Image, log: list[tuple]) -> Image:
    """What a power cut right after the last operation of ``log`` leaves."""
    model = Model(initial)
    for op in log:
        with contextlib.suppress(FsError):
            model.apply(op)
    return model.durable_image()


def persistence_points(log: list[tuple]) -> int:
    """How many persistence points a log holds."""
    return sum(1 for op in log if is_persistence_point(op))


def mode_of(node: Node) -> int:
    """The st_mode of a node."""
    kind = {"d": stat.S_IFDIR, "f": stat.S_IFREG, "l": stat.S_IFLNK}[node.kind]
    return kind | node.mode
