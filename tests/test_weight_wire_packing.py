"""A publication's bytes (creditrl.weights.packing, creditrl.weights.wire): safetensors written
with one copy and read back as views after a strict header check; chunks hashed on several
threads; chunks assembled in place from immutable buffers only."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from creditrl.weights.packing import pack, unpack
from creditrl.weights.wire import (
    WireAssembler,
    WireError,
    chunk_digests,
    decode_publication,
    encode_publication,
)

TENSORS = {
    "w": torch.randn(3, 5),
    "ids": torch.arange(7),
    "half": torch.ones(3, dtype=torch.bfloat16),
    "mask": torch.tensor([True, False, True]),
    "none": torch.empty(0, 4),
    "scalar": torch.tensor(2.5, dtype=torch.float64),
    "bytes": torch.arange(3, dtype=torch.uint8),
}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and torch.equal(a[k], b[k]) for k in a
    )


def test_pack_writes_what_safetensors_reads_and_unpack_reads_what_it_writes() -> None:
    packed = pack(TENSORS, {"aliases": "{}"})
    assert _same(safetensors_load(bytes(packed)), TENSORS)
    tensors, metadata = unpack(packed)
    assert _same(tensors, TENSORS) and metadata == {"aliases": "{}"}
    assert _same(unpack(safetensors_save(TENSORS, {"k": "v"}))[0], TENSORS)
    noncontiguous = {"t": torch.arange(12.0).reshape(3, 4).T}
    assert _same(unpack(pack(noncontiguous, {}))[0], noncontiguous)


def test_unpacked_tensors_are_views_of_a_writable_buffer_and_copies_of_a_read_only_one() -> None:
    packed = pack({"w": torch.zeros(4)}, {})
    tensors, _ = unpack(packed)
    tensors["w"][0] = 7.0
    assert unpack(packed)[0]["w"][0] == 7.0  # the same memory
    frozen = bytes(packed)
    unpack(frozen)[0]["w"][1] = 9.0
    assert unpack(frozen)[0]["w"][1] == 0.0


def _forged(header: dict, data: bytes) -> bytes:
    head = json.dumps(header).encode()
    return len(head).to_bytes(8, "little") + head + data


@pytest.mark.parametrize(
    ("header", "data", "match"),
    [
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, bytes(12),
         "end at byte 8 of 12"),
        ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8),
         "starts at 4"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
          "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8), "starts at 4"),
        ({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8),
         "8 bytes for shape"),
        ({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8),
         r"data_offsets are not \[start, stop\] in \[0, 8\]"),
        ({"a": {"dtype": "PICKLE", "shape": [2], "data_offsets": [0, 8]}}, bytes(8),
         "dtype 'PICKLE'"),
        ({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8),
         "shape is not a list of counts"),
        ({"a": {"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}}, bytes(4),
         "shape is not a list of counts"),
        ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8], "x": 1}}, bytes(8),
         "an entry is exactly"),
        ({"__metadata__": {"aliases": 3}}, b"", r"metadata is not \{string: string\}"),
    ],
)  # fmt: skip
def test_unpack_refuses_a_header_that_does_not_tile_its_bytes_exactly(
    header: dict, data: bytes, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        unpack(_forged(header, data))
    with pytest.raises(WireError, match="not safetensors") as err:
        decode_publication(_forged(header, data))
    assert err.value.reason == "payload"


def test_unpack_refuses_a_header_longer_than_its_buffer() -> None:
    with pytest.raises(ValueError, match="a header of 1000 bytes in 12 bytes"):
        unpack((1000).to_bytes(8, "little") + b"{}  ")
    with pytest.raises(ValueError, match="hold no safetensors header"):
        unpack(b"\x00")


def test_a_misaligned_tensor_is_read_through_a_copy() -> None:
    """safetensors lets a writer put an F32 at any byte: such a tensor is copied, not viewed."""
    header = {"b": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
              "a": {"dtype": "F32", "shape": [2], "data_offsets": [1, 9]}}  # fmt: skip
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    data = b"\x05" + torch.tensor([1.5, -2.0]).numpy().tobytes()
    tensors, _ = unpack(bytearray(len(head).to_bytes(8, "little") + head + data))
    assert tensors["a"].tolist() == [1.5, -2.0] and tensors["b"].tolist() == [5]


def test_chunks_are_hashed_in_order_whatever_the_threads() -> None:
    data = bytes(range(256)) * 1000
    expected = tuple(
        hashlib.sha256(data[i : i + 4096]).hexdigest() for i in range(0, len(data), 4096)
    )
    assert chunk_digests(data, 4096) == expected and chunk_digests(b"", 4096) == ()


def test_a_chunk_is_kept_from_an_immutable_buffer_only() -> None:
    """bytes or a read-only memoryview is copied into place; a writable view (it could change
    between its check and its copy) or a view of another shape is refused and counted."""
    manifest, payload = encode_publication("full", {"w": torch.arange(64.0)}, 1, chunk_bytes=64)
    assert payload.readonly and _same(safetensors_load(bytes(payload)), {"w": torch.arange(64.0)})
    assembler = WireAssembler(manifest)
    first = bytes(payload[:64])
    assert not assembler.add(0, memoryview(bytearray(first)))
    assert not assembler.add(0, memoryview(first).cast("I"))
    assert assembler.rejected == 2 and assembler.missing()[0] == 0
    assert assembler.add(0, memoryview(first).toreadonly()[:64])
    for i in assembler.missing():
        assert assembler.add(i, payload[i * 64 : (i + 1) * 64])
    assert decode_publication(assembler.payload())["w"].equal(torch.arange(64.0))
