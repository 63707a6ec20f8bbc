"""The Tinker SDK's messages as plain Python: decoded and checked, or encoded for the SDK.

Binary (protocol buffers, ``creditrl.tinker.wire``): the ``forward_backward`` request, the
``ForwardBackwardOutput`` and the ``SampleResponse``. JSON (already parsed by a bounded
decoder): a ``ModelInput`` and a ``TensorData``. Every decoder checks type, size and shape
against ``Limits`` and raises ``BadRequest`` (one line, answered as HTTP 400).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from creditrl.tinker.wire import (
    WireError,
    as_bytes,
    as_double,
    as_int,
    bytes_field,
    double_field,
    packed_ints,
    read_fields,
    text,
    varint_field,
)

__all__ = [
    "BadRequest",
    "Datum",
    "ForwardBackwardRequest",
    "Limits",
    "Span",
    "encode_forward_backward_output",
    "encode_sample_response",
    "model_input_tokens",
    "parse_forward_backward",
    "tensor_from_json",
]

DTYPE_FLOAT32, DTYPE_INT64, DTYPE_INT32 = 1, 2, 3
_NUMPY = {DTYPE_FLOAT32: np.float32, DTYPE_INT64: np.int64, DTYPE_INT32: np.int32}
_JSON_DTYPES = {"float32": torch.float32, "int64": torch.int64}


class BadRequest(ValueError):
    """A request the service refuses (HTTP ``status``, 400 unless given), with one line."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Limits:
    """Bounds on one request: datums, tokens of one sequence, tokens of all sequences, and
    ``loss_fn_inputs`` of one datum (each as long as its tokens)."""

    max_datums: int = 1024
    max_sequence_tokens: int = 8192
    max_total_tokens: int = 262_144
    max_inputs: int = 16


@dataclass(frozen=True)
class Span:
    """One provenance run of a datum (``PromptProvenanceSpan`` / ``SampledProvenanceSpan``):
    ``length`` consecutive positions that are positions ``[offset, offset + length)`` of the
    named sequence's request prompt (``kind`` "prompt") or sampled tokens ("sampled")."""

    kind: str
    sequence_id: str
    offset: int
    length: int


@dataclass
class Datum:
    """One training example: the input token ids, the loss inputs (1-D tensors, each as long
    as the input) and, when the client gave them, its provenance runs tiling the input tokens
    and the targets (``Datum.with_provenance``; checked against the stability records only for
    ``stable_reinforce``, whose recorded sampler log-probs land in ``recorded``)."""

    tokens: list[int]
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    input_spans: list[Span] | None = None
    target_spans: list[Span] | None = None
    recorded: torch.Tensor | None = None


@dataclass
class ForwardBackwardRequest:
    """A decoded ``/api/v1/forward_backward`` body."""

    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, float | str]
    forward_only: bool
    data: list[Datum]


def _check_tokens(tokens: list[int], limits: Limits) -> list[int]:
    if len(tokens) > limits.max_sequence_tokens:
        raise BadRequest(
            f"a sequence of {len(tokens)} tokens is longer than this service's limit of "
            f"{limits.max_sequence_tokens}"
        )
    if any(t < 0 or t >= 1 << 31 for t in tokens):
        raise BadRequest("token ids must be in [0, 2^31)")
    return tokens


def _tensor_from_proto(body: bytes, length: int) -> torch.Tensor:
    """A ``Tensor`` message (dense or sparse CSR, float32/int64/int32) of ``length`` values as
    a 1-D torch tensor (a 2-D one is flattened row by row; a CSR one is filled with zeros).
    Its size is checked against ``length`` before anything is allocated, and a CSR tensor's
    index arrays are checked (row pointers from 0 to the value count, never decreasing; column
    indices inside the shape) before it is filled in, with numpy (torch's CSR constructor does
    not check them, and ``to_dense`` of row pointers that decrease crashed the process)."""
    fields = read_fields(body, 64)
    dtype = as_int(fields, 3)
    if dtype not in _NUMPY:
        raise BadRequest(f"tensor dtype {dtype} is not float32, int64 or int32")
    shape = packed_ints(fields, 4, 8)
    if any(s < 0 for s in shape):
        raise BadRequest(f"tensor shape {shape} has a negative size")
    size = int(np.prod(shape, dtype=object)) if shape else None
    if size is not None and size != length:
        raise BadRequest(f"a tensor of shape {shape} has {size} values, not {length}")
    np_dtype = np.dtype(_NUMPY[dtype])
    out_dtype = np.float32 if dtype == DTYPE_FLOAT32 else np.int64
    if 2 in fields:
        csr = read_fields(as_bytes(fields, 2), 16)
        values = _array(as_bytes(csr, 1), np_dtype)
        crow = _array(as_bytes(csr, 2), np.dtype(np.int64))
        cols = _array(as_bytes(csr, 3), np.dtype(np.int64))
        if len(shape) != 2 or len(crow) != shape[0] + 1 or len(cols) != len(values):
            raise BadRequest("a sparse CSR tensor needs a 2-D shape and matching index arrays")
        steps = np.diff(crow)
        if crow[0] != 0 or crow[-1] != len(values) or bool((steps < 0).any()):
            raise BadRequest(
                "a sparse CSR tensor's row pointers must rise from 0 to its value count"
            )
        if len(cols) and (int(cols.min()) < 0 or int(cols.max()) >= shape[1]):
            raise BadRequest(f"a sparse CSR tensor has a column index outside its shape {shape}")
        dense = np.zeros(tuple(shape), dtype=out_dtype)
        dense[np.repeat(np.arange(shape[0]), steps), cols] = values
        return torch.from_numpy(dense.reshape(-1))
    values = _array(as_bytes(fields, 1), np_dtype)
    if len(values) != length:
        raise BadRequest(f"a tensor of {len(values)} values, not {length}")
    return torch.from_numpy(values.astype(out_dtype))


def _array(raw: bytes, dtype: np.dtype) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise BadRequest(f"{len(raw)} bytes are not a whole number of {dtype} values")
    return np.frombuffer(raw, dtype=dtype.newbyteorder("<")).astype(dtype)


def _datum_from_proto(body: bytes, limits: Limits) -> Datum:
    fields = read_fields(body, limits.max_sequence_tokens + limits.max_inputs + 64)
    tokens: list[int] = []
    for chunk in fields.get(1, []):
        parts = read_fields(chunk, 8) if isinstance(chunk, bytes) else {}
        if 1 not in parts:
            raise BadRequest("only token (encoded_text) inputs are supported: no images, no audio")
        encoded = read_fields(as_bytes(parts, 1), 4)
        tokens.extend(_array(as_bytes(encoded, 1), np.dtype(np.int32)).tolist())
        if len(tokens) > limits.max_sequence_tokens:
            break
    datum = Datum(_check_tokens(tokens, limits))
    entries = fields.get(2, [])
    if len(entries) > limits.max_inputs:
        raise BadRequest(
            f"a datum has {len(entries)} loss_fn_inputs; this service takes at most "
            f"{limits.max_inputs}"
        )
    for entry in entries:
        pair = read_fields(entry, 4) if isinstance(entry, bytes) else {}
        name = text(as_bytes(pair, 1), 64)
        try:
            datum.inputs[name] = _tensor_from_proto(as_bytes(pair, 2), len(tokens))
        except BadRequest as err:
            raise BadRequest(f"loss_fn_inputs[{name!r}]: {err}") from None
    if 3 in fields or 4 in fields:
        datum.input_spans = _spans(fields.get(3, []), len(tokens), "model_input_spans")
        datum.target_spans = _spans(fields.get(4, []), len(tokens), "loss_fn_input_spans")
    return datum


def _spans(entries: list, length: int, name: str) -> list[Span]:
    """Provenance runs (``ProvenanceSpan`` messages) that must tile ``length`` positions."""
    spans: list[Span] = []
    for entry in entries:
        arms = read_fields(entry, 4) if isinstance(entry, bytes) else {}
        kind = "prompt" if 1 in arms else "sampled" if 2 in arms else None
        if kind is None:
            raise BadRequest(f"{name}: a run is neither prompt_tokens nor sampled_tokens")
        run = read_fields(as_bytes(arms, 1 if kind == "prompt" else 2), 8)
        sequence_id = text(as_bytes(run, 1), 256)
        offset, size = as_int(run, 2), as_int(run, 3)
        if not sequence_id or offset < 0 or size < 0:
            raise BadRequest(f"{name}: a run needs a sequence_id, offset >= 0 and length >= 0")
        spans.append(Span(kind, sequence_id, offset, size))
        length -= size
        if length < 0:
            break
    if length != 0:
        raise BadRequest(f"{name}: the runs' lengths do not add up to the datum's positions")
    return spans


def parse_forward_backward(body: bytes, limits: Limits) -> ForwardBackwardRequest:
    """Decode and check a ``forward_backward`` request body (protocol buffers)."""
    try:
        fields = read_fields(body, limits.max_datums + 64)
        data = fields.get(3, [])
        if not data:
            raise BadRequest("forward_backward needs at least one datum")
        if len(data) > limits.max_datums:
            raise BadRequest(f"{len(data)} datums in one request; the limit is {limits.max_datums}")
        datums, total = [], 0
        for raw in data:  # the total is checked as it grows, before the next datum is decoded
            if not isinstance(raw, bytes):
                raise BadRequest("a datum must be a message")
            datums.append(_datum_from_proto(raw, limits))
            total += len(datums[-1].tokens)
            if total > limits.max_total_tokens:
                raise BadRequest(
                    f"more than {limits.max_total_tokens} tokens in one request (the limit)"
                )
        config: dict[str, float | str] = {}
        for entry in fields.get(5, []):
            pair = read_fields(entry, 4) if isinstance(entry, bytes) else {}
            config[text(as_bytes(pair, 1), 64)] = as_double(pair, 2)
        for entry in fields.get(7, []):
            pair = read_fields(entry, 4) if isinstance(entry, bytes) else {}
            value = read_fields(as_bytes(pair, 2), 4)
            key = text(as_bytes(pair, 1), 64)
            config[key] = text(as_bytes(value, 2), 256) if 2 in value else as_double(value, 1)
        return ForwardBackwardRequest(
            model_id=text(as_bytes(fields, 1), 256),
            seq_id=as_int(fields, 2),
            loss_fn=text(as_bytes(fields, 4), 64),
            config=config,
            forward_only=bool(as_int(fields, 6)),
            data=datums,
        )
    except WireError as err:
        raise BadRequest(f"forward_backward body is not a valid message: {err}") from None


def _batched_tensor(arrays: list[np.ndarray]) -> bytes:
    """A ``BatchedTensor`` of 1-D float32 arrays, one per datum (byte offsets)."""
    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([a.size * 4 for a in arrays])
    data = b"".join(np.ascontiguousarray(a, dtype="<f4").tobytes() for a in arrays)
    return (
        bytes_field(1, data)
        + bytes_field(2, offsets.astype("<i8").tobytes())
        + (varint_field(3, DTYPE_FLOAT32))
    )


def encode_forward_backward_output(
    outputs: dict[str, list[torch.Tensor]], metrics: dict[str, float], num_datums: int
) -> bytes:
    """A ``ForwardBackwardOutput``: per-datum 1-D float32 outputs by name (``logprobs``,
    ``elementwise_loss``), in one ``ArrayRecord``, and the metrics ("name:reduction")."""
    record = bytes_field(1, "ArrayRecord")
    for name, tensors in outputs.items():
        arrays = [t.detach().to(torch.float32).numpy() for t in tensors]
        record += bytes_field(2, bytes_field(1, name) + bytes_field(2, _batched_tensor(arrays)))
    record += varint_field(3, num_datums)
    body = bytes_field(1, "ArrayRecord") + bytes_field(2, record)
    for key, value in metrics.items():
        body += bytes_field(3, bytes_field(1, key) + double_field(2, float(value)))
    return body


@dataclass
class SampledSequence:
    """One sample: its token ids, their log-probs, and why it stopped (``stop``/``length``)."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: str


def encode_sample_response(
    sequences: list[SampledSequence], prompt_logprobs: list[float] | None
) -> bytes:
    """A ``SampleResponse``; ``prompt_logprobs`` NaN where a position is not scored."""
    body = b""
    for seq in sequences:
        message = varint_field(1, 0 if seq.stop_reason == "stop" else 1)
        message += bytes_field(2, np.asarray(seq.tokens, dtype="<i4").tobytes())
        message += bytes_field(3, np.asarray(seq.logprobs, dtype="<f4").tobytes())
        body += bytes_field(1, message)
    if prompt_logprobs is not None:
        body += bytes_field(2, np.asarray(prompt_logprobs, dtype="<f4").tobytes())
    return body


def model_input_tokens(value: Any, limits: Limits) -> list[int]:
    """The token ids of a JSON ``ModelInput`` (``{"chunks": [{"tokens": [...]}, ...]}``)."""
    chunks = value.get("chunks") if isinstance(value, dict) else None
    if not isinstance(chunks, list):
        raise BadRequest("a model input must be {'chunks': [...]}")
    tokens: list[int] = []
    for chunk in chunks:
        if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
            raise BadRequest("only token (encoded_text) inputs are supported: no images, no audio")
        ids = chunk.get("tokens")
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise BadRequest("a chunk's tokens must be a list of integers")
        tokens.extend(ids)
        if len(tokens) > limits.max_sequence_tokens:
            break
    return _check_tokens(tokens, limits)


def tensor_from_json(value: Any, limits: Limits) -> torch.Tensor:
    """A dense JSON ``TensorData`` (``{"data", "dtype", "shape"}``) as a torch tensor."""
    if not isinstance(value, dict) or value.get("dtype") not in _JSON_DTYPES:
        raise BadRequest("a tensor must be {'data': [...], 'dtype': 'float32'|'int64'}")
    if value.get("sparse_crow_indices") is not None:
        raise BadRequest("sparse tensors are not supported in JSON requests")
    data = value.get("data")
    if not isinstance(data, list) or len(data) > limits.max_total_tokens:
        raise BadRequest(
            f"a tensor's data must be a list of at most {limits.max_total_tokens} numbers"
        )
    if not all(type(x) in (int, float) for x in data):
        raise BadRequest("a tensor's data must hold numbers only")
    tensor = torch.tensor(data, dtype=_JSON_DTYPES[value["dtype"]])
    shape = value.get("shape")
    if shape is not None:
        if not isinstance(shape, list) or not all(type(s) is int and s >= 0 for s in shape):
            raise BadRequest("a tensor's shape must be a list of sizes")
        if int(np.prod(shape)) != len(data):
            raise BadRequest(f"tensor shape {shape} does not match its {len(data)} values")
        tensor = tensor.reshape(shape)
    return tensor
