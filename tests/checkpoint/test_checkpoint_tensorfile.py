"""The streaming writer produces files torch.load(weights_only=True) reads back exactly."""

import collections
import io
import random
import zipfile

import numpy as np
import pytest
import torch

from worldpipe.checkpoint.codec import PendingFile
from worldpipe.checkpoint.tensorfile import encode, encode_with_fallback


def _write(tmp_path, encoded, name="x.pt"):
    path = tmp_path / name
    path.write_bytes(b"".join(bytes(s) for s in encoded))
    assert path.stat().st_size == PendingFile(name, encoded).size  # the size the manifest records
    return path


def _assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor)
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.bool else a,
                           b.view(torch.uint8) if b.dtype == torch.bool else b)
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def _rich_object():
    w = torch.randn(6, 5)
    return {
        "f32": torch.randn(3, 4), "f64": torch.randn(2, dtype=torch.float64), "f16": torch.randn(5).half(),
        "bf16": torch.randn(7, dtype=torch.bfloat16), "i64": torch.arange(5), "i32": torch.arange(3, dtype=torch.int32),
        "i16": torch.arange(3, dtype=torch.int16), "i8": torch.arange(-3, 3, dtype=torch.int8),
        "u8": torch.arange(9, dtype=torch.uint8), "bool": torch.tensor([True, False, True]),
        "c64": torch.randn(2, dtype=torch.complex64), "scalar": torch.tensor(2.5), "empty": torch.empty(0, 3),
        "tied_a": w, "tied_b": w, "view": w[1:4, ::2], "transposed": w.t(),
        "param": torch.nn.Parameter(torch.ones(2)),
        "nested": collections.OrderedDict(a=[1, 2.5, (3, "x"), None, {4: True}]),
        "python_rng": random.getstate(), "pcg64": np.random.default_rng(1).bit_generator.state,
        "big_int": 2**100 + 7, "neg": -(2**70),
    }


@pytest.mark.parametrize("zip64", [False, True])
@pytest.mark.parametrize("mmap", [False, True])
def test_round_trip_weights_only(tmp_path, zip64, mmap):
    obj = _rich_object()
    path = _write(tmp_path, encode(obj, "model", force_zip64=zip64))
    loaded = torch.load(path, weights_only=True, mmap=mmap)
    expected = dict(obj)
    expected["param"] = obj["param"].detach()  # stored as a plain tensor, like state_dict() values
    _assert_same(expected, loaded)
    # Storage sharing is preserved like torch.save: tied weights and views share one storage.
    assert loaded["tied_a"].untyped_storage().data_ptr() == loaded["view"].untyped_storage().data_ptr()
    assert loaded["tied_a"] is loaded["tied_b"]
    assert loaded["transposed"].stride() == obj["transposed"].stride()


def test_layout_is_a_valid_aligned_zip(tmp_path):
    path = _write(tmp_path, encode({"w": torch.randn(100), "b": torch.randn(3)}, "model"))
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        assert names[0] == "model/data.pkl"
        assert {"model/byteorder", "model/version", "model/data/0", "model/data/1"} <= set(names)
        for info in zf.infolist():
            if info.filename.startswith("model/data/"):
                header = path.read_bytes()[info.header_offset:info.header_offset + 30]
                start = info.header_offset + 30 + int.from_bytes(header[26:28], "little") + \
                    int.from_bytes(header[28:30], "little")
                assert start % 64 == 0


def test_identical_content_gives_identical_bytes():
    a = encode({"w": torch.arange(10.0)}, "model")
    b = encode({"w": torch.arange(10.0)}, "model")
    assert b"".join(bytes(s) for s in a) == b"".join(bytes(s) for s in b)


def test_tensor_bytes_are_referenced_not_copied():
    t = torch.randn(1000)
    encoded = encode({"w": t}, "model")
    views = [s for s in encoded if isinstance(s, memoryview)]
    assert len(views) == 1
    t.add_(1.0)  # the segment aliases the tensor's memory
    assert bytes(views[0]) == t.numpy().tobytes()


def test_unsupported_objects_fall_back_to_torch_save(tmp_path):
    sparse = torch.eye(3).to_sparse()
    encoded = encode_with_fallback({"s": sparse})
    loaded = torch.load(io.BytesIO(b"".join(bytes(s) for s in encoded)), weights_only=True)
    assert torch.equal(loaded["s"].to_dense(), torch.eye(3))


_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
           torch.int8, torch.uint8, torch.bool, torch.complex64]


def _tensor_strategy():
    from hypothesis import strategies as st

    @st.composite
    def tensors(draw):
        dtype = draw(st.sampled_from(_DTYPES))
        shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=3))
        seed = draw(st.integers(0, 2**31 - 1))
        gen = torch.Generator().manual_seed(seed)
        t = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * torch.empty(0, dtype=dtype).element_size(),),
                          dtype=torch.uint8, generator=gen)
        t = t.view(dtype).reshape(shape) if dtype != torch.bool else (t % 2).bool().reshape(shape)
        if draw(st.booleans()) and t.dim() >= 2:
            t = t.transpose(0, 1)  # non-contiguous
        return t

    return tensors()


def test_property_round_trip():
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st

    from worldpipe.checkpoint import state_digest

    leaves = st.one_of(_tensor_strategy(), st.integers(-2**70, 2**70), st.floats(allow_nan=False),
                       st.text(max_size=5), st.none(), st.booleans())
    trees = st.recursive(leaves, lambda children: st.one_of(
        st.lists(children, max_size=3), st.tuples(children, children),
        st.dictionaries(st.one_of(st.text(max_size=4), st.integers(0, 9)), children, max_size=3)), max_leaves=12)

    @hypothesis.settings(max_examples=60, deadline=None)
    @hypothesis.given(st.dictionaries(st.text(max_size=6), trees, max_size=4))
    def check(obj):
        data = b"".join(bytes(s) for s in encode(obj, "model"))
        loaded = torch.load(io.BytesIO(data), weights_only=True)
        assert state_digest({"model": loaded}) == state_digest({"model": obj})

    check()
