"""values.py: non-tensor values as tagged JSON, exact round trips for every tag, and malformed documents refused."""

from __future__ import annotations

import io
import json
import math

import ml_dtypes
import numpy as np
import pytest

from dcp_zarr.format.values import (
    BYTES_TAG,
    BYTESIO_TAG,
    DICT_TAG,
    FLOAT_TAG,
    FROZENSET_TAG,
    MAX_JSON_BLOB_BYTES,
    NDARRAY_TAG,
    NUMPY_SCALAR_TAG,
    SET_TAG,
    TAGS,
    TUPLE_TAG,
    NotJSONError,
    decode_value,
    encode_value,
)


def stored(value):
    """What a reader gets back: the document goes through JSON text, as it does in zarr.json."""
    return decode_value(json.loads(json.dumps(encode_value(value), allow_nan=False)))


def test_plain_json_values_are_stored_as_themselves():
    value = {"lr": 0.5, "name": "run", "steps": [1, 2, 3], "done": False, "none": None, "nested": {"a": [True]}}
    assert encode_value(value) == value
    assert stored(value) == value


@pytest.mark.parametrize("value, tag", [
    ((1, "a", (2.5, None)), TUPLE_TAG),
    ({1: "one", (2, 3): "pair"}, DICT_TAG),
    ({"__tuple__": [1]}, DICT_TAG),  # a user's dict that looks like a tag
    (b"\x00\xffbytes", BYTES_TAG),
    ({3, "x", (1, 2)}, SET_TAG),
    (frozenset({1, 2}), FROZENSET_TAG),
])
def test_each_tag_round_trips_to_an_equal_value_of_the_same_type(value, tag):
    document = encode_value(value)
    assert tag in json.dumps(document)
    back = stored(value)
    assert back == value and type(back) is type(value)


def test_every_tag_written_is_one_of_the_tags_a_one_key_dict_is_recognised_by():
    values = [(1,), {1: 2}, b"x", {1}, frozenset(), io.BytesIO(b"x"), np.zeros(1), np.int8(1), math.nan]
    assert {next(iter(encode_value(value))) for value in values} == TAGS


@pytest.mark.parametrize("number", [math.inf, -math.inf])
def test_infinities_are_tagged_floats(number):
    assert encode_value(number) == {FLOAT_TAG: repr(number)}
    assert stored(number) == number


def test_nan_is_a_tagged_float_that_comes_back_nan():
    back = stored(math.nan)
    assert type(back) is float and math.isnan(back)


def test_negative_zero_keeps_its_sign():
    assert math.copysign(1.0, stored(-0.0)) == -1.0


def test_tuples_inside_lists_and_dicts_keep_their_types():
    value = {"betas": (0.9, 0.999), "history": [(1, 2), [3, (4,)]]}
    back = stored(value)
    assert back == value and type(back["betas"]) is tuple and type(back["history"][1][1]) is tuple


def test_a_set_gives_one_document_whatever_its_insertion_order():
    a, b = set(), set()
    for item in ("b", 3, "a", (1, 2)):
        a.add(item)
    for item in ((1, 2), "a", 3, "b"):
        b.add(item)
    assert json.dumps(encode_value(a)) == json.dumps(encode_value(b))


def test_a_bytesio_comes_back_with_its_whole_contents_positioned_at_zero():
    buffer = io.BytesIO(b"dataloader state")
    buffer.seek(5)
    assert BYTESIO_TAG in encode_value(buffer)
    back = stored(buffer)
    assert type(back) is io.BytesIO and back.tell() == 0 and back.read() == b"dataloader state"


@pytest.mark.parametrize("dtype", ["<f4", ">f8", "<i8", "|u1", "|b1", "<c16", "<f2"])
def test_a_numpy_array_comes_back_with_its_dtype_shape_and_bits(dtype):
    array = (np.arange(12) % 5).astype(dtype).reshape(3, 4)
    back = stored(array)
    assert type(back) is np.ndarray and back.dtype == array.dtype and back.shape == (3, 4)
    assert back.tobytes() == array.tobytes()
    back[0, 0] = 1  # writable, and its own memory rather than a view of the decoded bytes


def test_a_strided_numpy_array_is_stored_in_c_order():
    array = np.arange(20, dtype=np.int32).reshape(4, 5)[:, ::2].T
    assert np.array_equal(stored(array), array)


@pytest.mark.parametrize("scalar", [np.int64(-7), np.float32(0.1), np.uint8(255), np.bool_(True), np.complex64(1j)])
def test_a_numpy_scalar_comes_back_as_the_same_numpy_type(scalar):
    assert NUMPY_SCALAR_TAG in encode_value(scalar)
    back = stored(scalar)
    assert type(back) is type(scalar) and back == scalar


@pytest.mark.parametrize("value", [
    object(),
    b"x" * (MAX_JSON_BLOB_BYTES + 1),
    io.BytesIO(b"x" * (MAX_JSON_BLOB_BYTES + 1)),
    np.zeros(MAX_JSON_BLOB_BYTES // 8 + 1),
    np.array(["a"], dtype=object),
    np.array(["2024-01-01"], dtype="datetime64[D]"),
    np.zeros(3, dtype=ml_dtypes.bfloat16),  # its .str is '<V2': the dtype would not survive the round trip
    [1, {"inner": object()}],
    bytearray(b"ab"),
])
def test_values_that_are_not_json_are_refused_so_the_writer_stores_them_as_torch_save(value):
    with pytest.raises(NotJSONError):
        encode_value(value)


@pytest.mark.parametrize("document, message", [
    ({NDARRAY_TAG: {"dtype": "|O", "shape": [1], "data": ""}}, "not a plain numeric"),
    ({NDARRAY_TAG: {"dtype": "no-such-dtype", "shape": [1], "data": ""}}, "numpy does not know"),
    ({NDARRAY_TAG: {"shape": [1], "data": ""}}, "needs a dtype string"),
    ({NDARRAY_TAG: {"dtype": "<f4", "shape": [-1], "data": ""}}, "has shape"),
    ({NDARRAY_TAG: {"dtype": "<f4", "shape": "2", "data": "AAAAAA=="}}, "has shape"),
    ({NDARRAY_TAG: {"dtype": "<f4", "shape": [3], "data": "AAAAAA=="}}, "size"),  # 4 bytes: one float, not 3
    ({NDARRAY_TAG: {"dtype": "<f4", "shape": [1], "data": 7}}, "base64 text expected"),
    ({NUMPY_SCALAR_TAG: {"dtype": "<i4", "data": "AAAAAAAAAAA="}}, "holds 2 values, not 1"),
    ({BYTES_TAG: "not base64!"}, None),  # binascii.Error, a ValueError
    ({BYTES_TAG: 12}, "base64 text expected"),
    ({DICT_TAG: [[[1, 2], "value"]]}, "decoded to a list"),
    ({SET_TAG: [[1, 2]]}, "decoded to a list"),
])
def test_malformed_documents_are_refused_with_a_value_error(document, message):
    with pytest.raises(ValueError, match=message):
        decode_value(document)


def test_a_one_key_dict_whose_key_is_no_tag_decodes_as_a_dict():
    assert decode_value({"__unknown__": [1]}) == {"__unknown__": [1]}
