"""Encode objects holding tensors as ``torch.load``-compatible files, as a list of byte segments.

``torch.save`` pickles into a zip container (``archive/data.pkl`` + one ``archive/data/<key>`` record per
storage). This module produces the same container, but returns it as a list of segments instead of writing it:
small ``bytes`` headers interleaved with zero-copy ``memoryview`` s of the tensors' storages. Why:

* the publisher can write each storage with one large ``write`` (no pickling of tensor bytes, no copies), and
* a second thread can SHA-256 the very same segments while they are written, so hashing overlaps the I/O.

The result loads with ``torch.load(path, weights_only=True)``: the pickle references only
``torch._utils._rebuild_tensor_v2``, ``collections.OrderedDict`` and ``torch.<Dtype>Storage``, exactly as
``torch.save`` output does. The zip CRC-32 fields are written as zero (``torch.save`` does the same when
``torch.serialization.set_crc32_options(False)``; ``torch.load`` does not read them): integrity is the
checkpoint manifest's SHA-256, not the zip CRC. Data records are 64-byte aligned, so ``mmap=True`` works.

Objects that this encoder does not handle (sparse/quantized/nested tensors, tensor subclasses, exotic dtypes,
storages viewed with two dtypes) raise :class:`UnsupportedObject`; callers fall back to ``torch.save``.
"""

from __future__ import annotations

import collections
import io
import pickle
import struct
import sys

import torch
import torch._utils

# Storage classes that torch.load's weights_only unpickler accepts, by dtype.
_STORAGE_TYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "DoubleStorage",
    torch.float32: "FloatStorage",
    torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage",
    torch.int64: "LongStorage",
    torch.int32: "IntStorage",
    torch.int16: "ShortStorage",
    torch.int8: "CharStorage",
    torch.uint8: "ByteStorage",
    torch.bool: "BoolStorage",
    torch.complex64: "ComplexFloatStorage",
    torch.complex128: "ComplexDoubleStorage",
}

ALIGNMENT = 64  # torch's storage alignment: data records start on 64-byte boundaries
_PICKLE_PROTOCOL = 2  # what torch.save uses
_ZIP32_MAX = 0xFFFFFFFF
_ZIP16_MAX = 0xFFFF
_DOS_DATE = 0x21  # 1980-01-01: a fixed timestamp keeps identical content byte-identical
_PAD_FIELD_ID = 0x4246  # "FB", the extra-field id torch uses for its alignment padding


class UnsupportedObject(TypeError):
    """The object holds something this encoder does not serialize; use ``torch.save`` instead."""


Segment = bytes | memoryview


class _StorageRef(tuple):
    """Torch's ``("storage", type, key, "cpu", numel)`` persistent id, marked as one for ``persistent_id``."""


class _Pickler(pickle.Pickler):
    """Pickles tensors as ``_rebuild_tensor_v2`` over storage references collected in ``storages``."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, protocol=_PICKLE_PROTOCOL)
        # storage identity -> (ref, dtype, uint8 view of the storage bytes)
        self.storages: dict[tuple, tuple[_StorageRef, torch.dtype, torch.Tensor]] = {}

    def persistent_id(self, obj):  # noqa: D102 - pickle hook
        return tuple(obj) if type(obj) is _StorageRef else None

    def reducer_override(self, tensor):  # noqa: D102 - pickle hook
        if not isinstance(tensor, torch.Tensor):
            return NotImplemented
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            raise UnsupportedObject(f"tensor subclass {type(tensor).__name__}")
        if tensor.layout != torch.strided or tensor.is_quantized or tensor.is_nested:
            raise UnsupportedObject(f"tensor layout {tensor.layout}")
        if tensor.dtype not in _STORAGE_TYPE_NAMES:
            raise UnsupportedObject(f"dtype {tensor.dtype}")
        if tensor.device.type == "meta":
            raise UnsupportedObject("meta tensor")
        tensor = tensor.detach()
        if tensor.device.type != "cpu":
            # Device tensors are copied compactly; they load on CPU (map_location decides the device).
            tensor = tensor.to("cpu")
        storage = tensor.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        # Tensors sharing a storage (tied weights, views) share one record, as with torch.save.
        ident = (ptr, nbytes) if ptr else ("empty", len(self.storages))
        entry = self.storages.get(ident)
        if entry is None:
            itemsize = tensor.element_size()
            if nbytes % itemsize:
                raise UnsupportedObject("storage size is not a multiple of the element size")
            ref = _StorageRef(("storage", getattr(torch, _STORAGE_TYPE_NAMES[tensor.dtype]), str(len(self.storages)),
                               "cpu", nbytes // itemsize))
            entry = (ref, tensor.dtype, torch.empty(0, dtype=torch.uint8).set_(storage))
            self.storages[ident] = entry
        elif entry[1] != tensor.dtype:
            raise UnsupportedObject("one storage viewed with two dtypes")
        return (
            torch._utils._rebuild_tensor_v2,
            (entry[0], tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), False,
             collections.OrderedDict()),
        )


def _local_header(name: bytes, size: int, offset: int, zip64: bool) -> bytes:
    extra = struct.pack("<HHQQ", 0x0001, 16, size, size) if zip64 else b""
    pad = (-(offset + 30 + len(name) + len(extra))) % ALIGNMENT
    if 0 < pad < 4:  # an extra field needs 4 bytes of header
        pad += ALIGNMENT
    if pad:
        extra += struct.pack("<HH", _PAD_FIELD_ID, pad - 4) + b"\0" * (pad - 4)
    size32 = _ZIP32_MAX if zip64 else size
    return struct.pack(
        "<IHHHHHIIIHH", 0x04034B50, 45 if zip64 else 20, 0, 0, 0, _DOS_DATE, 0, size32, size32, len(name),
        len(extra),
    ) + name + extra


def _central_entry(name: bytes, size: int, offset: int, zip64: bool) -> bytes:
    if zip64:
        extra = struct.pack("<HHQQQ", 0x0001, 24, size, size, offset)
        size32 = off32 = _ZIP32_MAX
    else:
        extra, size32, off32 = b"", size, offset
    version = 45 if zip64 else 20
    return struct.pack(
        "<IHHHHHHIIIHHHHHII", 0x02014B50, version, version, 0, 0, 0, _DOS_DATE, 0, size32, size32, len(name),
        len(extra), 0, 0, 0, 0, off32,
    ) + name + extra


def build_zip(records: list[tuple[str, Segment]], archive: str, force_zip64: bool = False) -> list[Segment]:
    """Lay out ``records`` (name, data) as an uncompressed, 64-byte-aligned zip under ``archive/``.

    ``force_zip64`` writes ZIP64 fields even for small files (tests use it to exercise the >4 GiB path).
    """
    out: list[Segment] = []
    central: list[tuple[bytes, int, int, bool]] = []
    offset = 0
    for rec_name, data in records:
        name = f"{archive}/{rec_name}".encode()
        size = len(data) if isinstance(data, bytes) else data.nbytes
        zip64 = force_zip64 or size >= _ZIP32_MAX or offset >= _ZIP32_MAX
        header = _local_header(name, size, offset, zip64)
        out += [header, data]
        central.append((name, size, offset, zip64))
        offset += len(header) + size
    cd = b"".join(_central_entry(*entry) for entry in central)
    count, cd_size = len(central), len(cd)  # the central directory starts at ``offset``
    if force_zip64 or count >= _ZIP16_MAX or offset >= _ZIP32_MAX or cd_size >= _ZIP32_MAX:
        cd += struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 45, 45, 0, 0, count, count, cd_size, offset)
        cd += struct.pack("<IIQI", 0x07064B50, 0, offset + cd_size, 1)
        cd += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, _ZIP16_MAX, _ZIP16_MAX, _ZIP32_MAX, _ZIP32_MAX, 0)
    else:
        cd += struct.pack("<IHHHHIIH", 0x06054B50, 0, 0, count, count, cd_size, offset, 0)
    return [*out, cd]


def encode(obj: object, archive: str = "archive", force_zip64: bool = False) -> list[Segment]:
    """Encode ``obj`` as a ``torch.load(weights_only=True)``-loadable file, referencing tensor memory.

    The returned segments alias the tensors' storages: they must not be modified until the file is written.
    Raises :class:`UnsupportedObject` when ``obj`` holds something this encoder does not handle.
    """
    buf = io.BytesIO()
    pickler = _Pickler(buf)
    pickler.dump(obj)
    records: list[tuple[str, Segment]] = [
        ("data.pkl", buf.getvalue()),
        (".format_version", b"1"),
        (".storage_alignment", str(ALIGNMENT).encode()),
        ("byteorder", sys.byteorder.encode()),
    ]
    for ref, _dtype, raw in pickler.storages.values():
        # numpy() shares memory with `raw`, which keeps the storage alive while the segment exists.
        records.append((f"data/{ref[2]}", memoryview(raw.numpy()).cast("B")))  # ref[2]: the storage key
    records += [("version", b"3\n"), (".data/serialization_id", b"0" * 40)]
    return build_zip(records, archive, force_zip64)


def encode_with_fallback(obj: object, archive: str = "archive") -> list[Segment]:
    """:func:`encode`, or ``torch.save`` into memory for objects :func:`encode` does not support."""
    try:
        return encode(obj, archive)
    except UnsupportedObject:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return [buf.getvalue()]
