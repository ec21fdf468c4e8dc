"""Every supported torch dtype survives zarr-python (and TensorStore) bit-exactly."""

import json
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import tensorstore
import torch
import zarr

from dcp_zarr.format.torch_arrays import (
    UnsupportedDtypeError,
    numpy_as_tensor,
    numpy_dtype,
    tensor_as_numpy,
    torch_dtype_from_name,
    torch_dtype_from_zarr_name,
    torch_dtype_name,
    zarr_dtype_name,
)

FLOATS = [torch.float64, torch.float32, torch.float16]
ML_FLOATS = [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64]
COMPLEX = [torch.complex64, torch.complex128]
SUPPORTED = FLOATS + ML_FLOATS + INTS + COMPLEX + [torch.bool]
# (signalling or payload-carrying NaN, negative NaN) as bits
ODD_NANS = {
    torch.float64: [0x7FF0000000000001, 0xFFF8000000000123],
    torch.float32: [0x7F800001, 0xFFC00123],
    torch.float16: [0x7C01, 0xFE01],
    torch.bfloat16: [0x7F81, 0xFFC1],
    torch.float8_e4m3fn: [0x7F, 0xFF],
    torch.float8_e5m2: [0x7D, 0xFE],
}
UNSUPPORTED = [torch.quint8, torch.qint32, torch.uint1, torch.float4_e2m1fn_x2, torch.float8_e4m3fnuz, torch.complex32]


def awkward_tensor(dtype: torch.dtype, shape=(7, 5)) -> torch.Tensor:
    """Random bit patterns (every NaN payload, subnormal and extreme included), with named specials up front."""
    gen = torch.Generator().manual_seed(zlib.crc32(str(dtype).encode()))
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    n = int(np.prod(shape))
    t = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=gen).view(dtype).clone()
    if dtype.is_floating_point or dtype.is_complex:
        finfo = torch.finfo(dtype.to_real())
        specials = [float("nan"), float("inf"), float("-inf"), -0.0, finfo.max, -finfo.max, finfo.tiny / 2][:n]
        if dtype == torch.float8_e4m3fn:  # no infinities in this format: they would become NaN
            specials = [s for s in specials if abs(s) != float("inf")]
        real = torch.tensor(specials, dtype=torch.float64)
        t[: len(specials)] = torch.complex(real, real.flip(0)) if dtype.is_complex else real.to(dtype)
        if dtype in ODD_NANS and n >= len(specials) + 2:  # a float round trip would quiet or canonicalise these
            t.view(torch.uint8).numpy().view(f"<u{dtype.itemsize}")[-2:] = ODD_NANS[dtype]
    else:
        info = np.iinfo(numpy_dtype(dtype))
        t.numpy()[: min(n, 2)] = [info.min, info.max][:n]
    return t.reshape(shape)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes, for comparisons where NaN != NaN and -0.0 == 0.0 would lie."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def write_with_zarr(path: Path, t: torch.Tensor, chunks) -> None:
    array = zarr.create_array(
        store=path,
        shape=tuple(t.shape),
        dtype=numpy_dtype(t.dtype),
        chunks=chunks,
        fill_value=0,
        compressors=None,
        config={"write_empty_chunks": True},
    )
    array[...] = tensor_as_numpy(t)


def read_with_zarr(path: Path, dtype: torch.dtype) -> torch.Tensor:
    return numpy_as_tensor(zarr.open_array(path, mode="r")[...], dtype)


def open_with_tensorstore(path: Path, **spec):
    return tensorstore.open({"driver": "zarr3", "kvstore": {"driver": "file", "path": str(path)}, **spec}).result()


@pytest.mark.parametrize("dtype", SUPPORTED, ids=str)
def test_round_trip_through_zarr_is_bit_exact(tmp_path, dtype):
    t = awkward_tensor(dtype)
    write_with_zarr(tmp_path / "a", t, chunks=(3, 2))  # edge chunks are partial on both axes
    got = read_with_zarr(tmp_path / "a", dtype)
    assert got.dtype == dtype and got.shape == t.shape
    assert torch.equal(bits(got), bits(t))


@pytest.mark.parametrize("dtype", SUPPORTED, ids=str)
def test_zarr_json_names_the_data_type(tmp_path, dtype):
    write_with_zarr(tmp_path / "a", awkward_tensor(dtype, (4,)), chunks=(4,))
    metadata = json.loads((tmp_path / "a" / "zarr.json").read_text())
    assert metadata["data_type"] == zarr_dtype_name(dtype)


@pytest.mark.parametrize("dtype", SUPPORTED, ids=str)
def test_zero_dimensional_round_trip(tmp_path, dtype):
    t = awkward_tensor(dtype, (1,)).reshape(())
    write_with_zarr(tmp_path / "a", t, chunks=())
    got = read_with_zarr(tmp_path / "a", dtype)
    assert got.shape == () and torch.equal(bits(got), bits(t))


@pytest.mark.parametrize("dtype", SUPPORTED, ids=str)
def test_non_contiguous_tensor_is_viewed_not_copied(tmp_path, dtype):
    t = awkward_tensor(dtype, (6, 8)).t()[::2, 1:]
    a = tensor_as_numpy(t)
    assert a.__array_interface__["data"][0] == t.data_ptr()
    assert a.shape == tuple(t.shape) and a.strides == tuple(s * t.itemsize for s in t.stride())
    write_with_zarr(tmp_path / "a", t, chunks=(3, 2))
    assert torch.equal(bits(read_with_zarr(tmp_path / "a", dtype)), bits(t))


@pytest.mark.parametrize("dtype", SUPPORTED, ids=str)
def test_numpy_as_tensor_shares_memory(dtype):
    a = tensor_as_numpy(awkward_tensor(dtype))
    t = numpy_as_tensor(a, dtype)
    assert t.dtype == dtype and t.data_ptr() == a.__array_interface__["data"][0]


def test_numpy_as_tensor_accepts_byte_swapped_and_reversed_arrays():
    values = np.array([1.5, -0.0, np.inf], dtype=">f4")
    assert torch.equal(bits(numpy_as_tensor(values, torch.float32)), bits(torch.tensor([1.5, -0.0, np.inf])))
    assert numpy_as_tensor(values.astype("<f4")[::-1], torch.float32).tolist() == [np.inf, -0.0, 1.5]


def test_numpy_as_tensor_rejects_a_different_type():
    with pytest.raises(UnsupportedDtypeError, match="torch.bfloat16"):
        numpy_as_tensor(np.zeros(3, dtype=np.float16), torch.bfloat16)


@pytest.mark.parametrize("dtype", SUPPORTED, ids=str)
def test_names_round_trip(dtype):
    assert torch_dtype_from_zarr_name(zarr_dtype_name(dtype)) == dtype
    assert torch_dtype_from_name(torch_dtype_name(dtype)) == dtype
    assert torch_dtype_name(dtype) == str(dtype)
    assert numpy_dtype(dtype).itemsize == dtype.itemsize


def test_ml_dtypes_floats_use_tensorstore_names():
    assert [zarr_dtype_name(d) for d in ML_FLOATS] == ["bfloat16", "float8_e4m3fn", "float8_e5m2"]


@pytest.mark.parametrize("dtype", ML_FLOATS, ids=str)
def test_tensorstore_reads_what_zarr_python_wrote(tmp_path, dtype):
    t = awkward_tensor(dtype)
    write_with_zarr(tmp_path / "a", t, chunks=(3, 2))
    store = open_with_tensorstore(tmp_path / "a")
    assert store.dtype.name == zarr_dtype_name(dtype)
    got = store.read().result()
    assert got.dtype == numpy_dtype(dtype)
    assert torch.equal(bits(numpy_as_tensor(got, dtype)), bits(t))


def test_zarr_python_reads_bfloat16_that_tensorstore_wrote(tmp_path):
    t = awkward_tensor(torch.bfloat16, (5, 3))
    metadata = {
        "shape": [6, 3],  # one row never written: it must read back as the fill value's exact bits
        "data_type": "bfloat16",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [2, 3]}},
        "fill_value": "0x7fc1",
    }
    store = open_with_tensorstore(tmp_path / "a", metadata=metadata, create=True)
    store[:5].write(tensor_as_numpy(t)).result()
    got = read_with_zarr(tmp_path / "a", torch.bfloat16)
    assert torch.equal(bits(got[:5]), bits(t))
    assert got[5].view(torch.uint16).tolist() == [0x7FC1] * 3


@pytest.mark.parametrize(
    ("dtype", "fill_value", "expected_bits"),
    [
        (torch.bfloat16, "0x7fc1", 0x7FC1),  # zarr alone would parse 4 hex digits as float16
        (torch.bfloat16, "0xff81", 0xFF81),
        (torch.bfloat16, 1.5, 0x3FC0),
        (torch.bfloat16, "NaN", 0x7FC0),
        (torch.bfloat16, "-Infinity", 0xFF80),
        (torch.float8_e4m3fn, "0x01", 0x01),
        (torch.float8_e4m3fn, -0.0, 0x80),
        (torch.float8_e4m3fn, "NaN", 0x7F),
        (torch.float8_e5m2, "0x7d", 0x7D),
        (torch.float8_e5m2, "Infinity", 0x7C),
        (torch.float8_e5m2, 0.5, 0x38),
    ],
)
def test_fill_value_keeps_its_bits_through_zarr_json(tmp_path, dtype, fill_value, expected_bits):
    zarr.create_array(store=tmp_path / "a", shape=(3,), dtype=numpy_dtype(dtype), chunks=(2,), fill_value=fill_value)
    expected = torch.from_numpy(np.full(3, expected_bits, dtype=f"<u{dtype.itemsize}"))
    assert torch.equal(bits(read_with_zarr(tmp_path / "a", dtype)), bits(expected))
    from_tensorstore = numpy_as_tensor(open_with_tensorstore(tmp_path / "a").read().result(), dtype)
    assert torch.equal(bits(from_tensorstore), bits(expected))


def test_fill_value_rejects_hex_of_the_wrong_width(tmp_path):
    with pytest.raises(ValueError, match="0x7fc00000"):
        zarr.create_array(store=tmp_path / "a", shape=(3,), dtype=numpy_dtype(torch.bfloat16), fill_value="0x7fc00000")


def test_big_endian_bfloat16_is_refused_not_misread(tmp_path):
    write_with_zarr(tmp_path / "a", awkward_tensor(torch.bfloat16, (4,)), chunks=(4,))
    zarr_json = tmp_path / "a" / "zarr.json"
    metadata = json.loads(zarr_json.read_text())
    metadata["codecs"] = [{"name": "bytes", "configuration": {"endian": "big"}}]
    zarr_json.write_text(json.dumps(metadata))
    with pytest.raises(ValueError, match="little-endian only"):
        zarr.open_array(tmp_path / "a", mode="r")[...]


@pytest.mark.slow
def test_importing_twice_keeps_the_data_types_registered():
    script = (
        "import importlib, torch, zarr, dcp_zarr.format.torch_arrays as d; importlib.reload(d); importlib.reload(d);"
        "a = zarr.create_array(store={}, shape=(2,), dtype=d.numpy_dtype(torch.bfloat16));"
        "assert a.metadata.data_type.to_json(3) == 'bfloat16'"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", script], check=True, cwd=root)


@pytest.mark.parametrize("dtype", UNSUPPORTED, ids=str)
def test_unsupported_dtype_is_refused_by_name(dtype):
    for convert in (zarr_dtype_name, numpy_dtype, torch_dtype_name):
        with pytest.raises(UnsupportedDtypeError, match=str(dtype)) as raised:
            convert(dtype)
        assert isinstance(raised.value, TypeError)
    with pytest.raises(UnsupportedDtypeError, match=str(dtype)):
        torch_dtype_from_name(str(dtype))


def test_unsupported_tensor_is_refused_by_name():
    with pytest.raises(UnsupportedDtypeError, match="torch.float8_e4m3fnuz"):
        tensor_as_numpy(torch.zeros(2, dtype=torch.float8_e4m3fnuz))


@pytest.mark.parametrize("name", ["float8_e4m3", "float4_e2m1fn", "r16", "string"])
def test_unknown_zarr_data_type_is_refused_by_name(name):
    with pytest.raises(UnsupportedDtypeError, match=name):
        torch_dtype_from_zarr_name(name)


def test_a_state_without_ml_dtypes_types_never_imports_ml_dtypes(tmp_path):
    # importing ml_dtypes 0.7.0 takes about 0.5 s: a fresh process paid it on its first save of float32 tensors
    script = (
        "import sys, torch, torch.distributed.checkpoint as dcp, zarr; from dcp_zarr import ZarrReader, ZarrWriter;"
        f"path = {str(tmp_path / 'ckpt')!r}; state = {{'w': torch.ones(3, 2), 'n': torch.arange(4)}};"
        "dcp.save(state, storage_writer=ZarrWriter(path)); dcp.load(state, storage_reader=ZarrReader(path));"
        "assert zarr.open_array(path + '/w', mode='r')[...].sum() == 6;"
        "assert 'ml_dtypes' not in sys.modules, 'ml_dtypes was imported';"
        "dcp.save({'b': torch.ones(2, dtype=torch.bfloat16)}, storage_writer=ZarrWriter(path + '-b'));"
        "assert zarr.open_array(path + '-b/b', mode='r').metadata.data_type.to_json(3) == 'bfloat16'"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-W", "ignore", "-c", script], check=True, cwd=root)
