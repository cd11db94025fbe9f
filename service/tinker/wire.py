"""The Tinker API's protobuf bodies, read and written without numpy (the standard library's array module): a
forward_backward request into plain values, the forward_backward and sample results into the bytes the SDK parses
(tinker/proto/response_conv.py), and a JSON model input (a sample request's prompt) into its tokens.

What the SDK sends (tinker 0.38.0, tinker/proto/request_conv.py and resources/training.py): a ModelInput as chunks,
a text chunk's tokens as int32 little-endian bytes; each loss_fn_inputs value a Tensor of dtype float32 or int64
with its shape, dense bytes or sparse CSR (values, then crow and col indices as int64). A 1-D tensor holds one value
per input position; a 2-D tensor (N, K) holds K per position (top-K distillation's target_tokens and weights with
cross_entropy), sent sparse when that is smaller, every unlisted entry 0 (the pad value the SDK converts with is not
on the wire). forward() is the same request with forward_only set. A batch too large for one request (over 1,024
datums or about 5 MB) arrives as several requests of this same form, each with its own seq_id.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from service.tinker.schema import pb

PROTOBUF_CONTENT_TYPE = "application/x-protobuf"
# The SDK reads the bare class name of the output records (the JSON shape's `loss_fn_output_type`).
OUTPUT_TYPE = "ArrayRecord"
# The SDK combines the metrics of a chunked forward_backward by the reduction after the one colon of each key
# (tinker/lib/chunked_fwdbwd_helpers.py): a key with no colon or two fails there, an unknown reduction is dropped.
METRIC_REDUCTIONS = frozenset({"mean", "sum", "min", "max", "slack", "hash2", "unique"})
STOP_REASONS = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}

# array typecodes of the wire's fixed widths (checked: C's int is 4 bytes, long long 8 on every platform we run)
_INT32, _INT64, _FLOAT32 = "i", "q", "f"
_TYPECODES = {pb.DTYPE_FLOAT32: _FLOAT32, pb.DTYPE_INT64: _INT64}
assert array(_INT32).itemsize == 4 and array(_INT64).itemsize == 8 and array(_FLOAT32).itemsize == 4
_SWAP = sys.byteorder != "little"  # the wire is little-endian


class WireError(ValueError):
    """A body this service cannot read or serve; the message names the field."""


@dataclass(frozen=True)
class WireDatum:
    tokens: list[int]  # the model input's text chunks, concatenated
    # loss_fn_inputs by name, one entry per input position: a number, or K numbers for an (N, K) tensor.
    # "target_tokens" (ints) is always there; "weights", "logprobs", "advantages" (floats) when sent.
    inputs: dict[str, list]


@dataclass(frozen=True)
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    forward_only: bool
    loss_fn: str
    loss_fn_config: dict[str, float]
    datums: list[WireDatum]


def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    """A POST /api/v1/forward_backward body (a ForwardBackwardRequest, uncompressed) as plain values."""
    try:
        request = pb.ForwardBackwardRequest.FromString(body)
    except DecodeError as exc:
        raise WireError(f"the body is not a ForwardBackwardRequest protobuf: {exc}") from exc
    if not request.model_id:
        raise WireError("model_id: missing")
    if request.seq_id < 1:  # the SDK numbers a client's requests from 1; 0 is a request sent without one
        raise WireError(f"seq_id: {request.seq_id}, the SDK numbers requests from 1")
    if not request.loss_fn:
        raise WireError("loss_fn: missing")
    if not request.data:
        raise WireError("data: no datums")
    return ForwardBackwardCall(
        model_id=request.model_id, seq_id=request.seq_id, forward_only=request.forward_only,
        loss_fn=request.loss_fn, loss_fn_config=_loss_fn_config(request),
        datums=[_datum(datum, i) for i, datum in enumerate(request.data)])


def encode_forward_backward(logprobs: Sequence[Sequence[float] | Sequence[Sequence[float]]],
                            metrics: Mapping[str, float]) -> bytes:
    """A ForwardBackwardOutput: per datum its target tokens' log-probs (`loss_fn_outputs[i]["logprobs"]`), one per
    position, or rows of K for an (N, K) target; and the metrics, keyed `name:reduction`."""
    for key in metrics:
        name, colon, reduction = key.partition(":")
        if not name or not colon or reduction not in METRIC_REDUCTIONS:
            raise WireError(f"metrics[{key!r}]: keys are name:reduction, the reduction one of "
                            f"{sorted(METRIC_REDUCTIONS)}")
    output = pb.ForwardBackwardOutput(loss_fn_output_type=OUTPUT_TYPE)
    for key, value in metrics.items():
        output.metrics[key] = float(value)
    # One record per run of datums whose values have one trailing shape: a record's tensor is rectangular past
    # its first dimension, and the SDK reads any number of records in order.
    for trailing, run in _runs_by_trailing_shape(logprobs):
        record = output.loss_fn_outputs.add(type_tag=OUTPUT_TYPE, num_datums=len(run))
        field = record.fields["logprobs"]
        field.dtype = pb.DTYPE_FLOAT32
        field.trailing_shape.extend(trailing)
        data, offsets = array(_FLOAT32), array(_INT64, [0])
        for values in run:
            data.extend(values)
            offsets.append(len(data) * data.itemsize)  # byte offsets, the first datum's start included
        field.data, field.offsets = _to_bytes(data), _to_bytes(offsets)
    return output.SerializeToString()


def encode_sample(sequences: Sequence[tuple[Sequence[int], Sequence[float], str]],
                  prompt_logprobs: Sequence[float | None] | None) -> bytes:
    """A SampleResponse: per sample (tokens, their log-probs, stop reason "stop" or "length"), and the prompt's
    log-probs when asked for, None (sent as NaN, which the SDK reads back as None) where there is none: position 0."""
    response = pb.SampleResponse()
    for i, (tokens, logprobs, stop_reason) in enumerate(sequences):
        if stop_reason not in STOP_REASONS:
            raise WireError(f"sequences[{i}].stop_reason: {stop_reason!r}, the SDK knows {sorted(STOP_REASONS)}")
        if len(logprobs) != len(tokens):
            raise WireError(f"sequences[{i}]: {len(logprobs)} logprobs for {len(tokens)} tokens")
        sequence = response.sequences.add(stop_reason=STOP_REASONS[stop_reason])
        sequence.tokens = _to_bytes(array(_INT32, tokens))
        sequence.logprobs = _to_bytes(array(_FLOAT32, logprobs))
    if prompt_logprobs is not None:
        response.prompt_logprobs = _to_bytes(array(_FLOAT32, [math.nan if v is None else v for v in prompt_logprobs]))
    return response.SerializeToString()


def model_input_tokens(json_model_input: object, field: str = "prompt") -> list[int]:
    """The tokens of a ModelInput as the SDK writes it in JSON ({"chunks": [{"type": "encoded_text", "tokens": [...]},
    ...]}), its text chunks concatenated; `field` names it in errors."""
    chunks = json_model_input.get("chunks") if isinstance(json_model_input, Mapping) else None
    if not isinstance(chunks, list):
        raise WireError(f"{field}.chunks: missing, a ModelInput is a list of chunks")
    tokens: list[int] = []
    for j, chunk in enumerate(chunks):
        kind = chunk.get("type", "encoded_text") if isinstance(chunk, Mapping) else None
        if kind != "encoded_text":
            raise WireError(f"{field}.chunks[{j}]: {kind!r} chunks are not served, only 'encoded_text'")
        values = chunk.get("tokens")
        if not isinstance(values, list) or not all(type(t) is int for t in values):
            raise WireError(f"{field}.chunks[{j}].tokens: a list of token ids is required")
        tokens.extend(values)
    return tokens


def _loss_fn_config(request) -> dict[str, float]:
    # The SDK writes numbers to both maps and strings to the second only; the second is the one to read when set.
    if not request.loss_fn_config_v2:
        return dict(request.loss_fn_config)
    config = {}
    for key, value in request.loss_fn_config_v2.items():
        if value.WhichOneof("value") != "number":
            raise WireError(f"loss_fn_config[{key!r}]: only numbers are served")
        config[key] = value.number
    return config


def _datum(datum, i: int) -> WireDatum:
    tokens: list[int] = []
    for j, chunk in enumerate(datum.model_input):
        kind = chunk.WhichOneof("chunk")
        if kind != "encoded_text":
            raise WireError(f"data[{i}].model_input[{j}]: {kind or 'empty'} chunks are not served, only encoded_text")
        tokens.extend(_numbers(chunk.encoded_text.tokens, _INT32, f"data[{i}].model_input[{j}].tokens"))
    inputs: dict[str, list] = {}
    for name in sorted(datum.loss_fn_inputs):
        where = f"data[{i}].loss_fn_inputs[{name!r}]"
        values = _tensor(datum.loss_fn_inputs[name], where)
        if len(values) != len(tokens):
            raise WireError(f"{where}: {len(values)} positions for {len(tokens)} input tokens")
        inputs[name] = values
    target = datum.loss_fn_inputs.get("target_tokens")
    if target is None:
        raise WireError(f"data[{i}].loss_fn_inputs: no 'target_tokens'")
    if target.dtype != pb.DTYPE_INT64:
        raise WireError(f"data[{i}].loss_fn_inputs['target_tokens']: token ids are int64")
    return WireDatum(tokens=tokens, inputs=inputs)


def _tensor(tensor, where: str) -> list:
    """A Tensor's values per position: numbers for 1-D, rows of K for (N, K)."""
    typecode = _TYPECODES.get(tensor.dtype)
    if typecode is None:
        name = pb.DType.Name(tensor.dtype) if tensor.dtype in pb.DType.values() else str(tensor.dtype)
        raise WireError(f"{where}: dtype {name} is not served, only DTYPE_FLOAT32 and DTYPE_INT64")
    shape = list(tensor.shape)
    if len(shape) > 2 or any(n < 0 for n in shape):
        raise WireError(f"{where}: shape {shape}, only 1-D (N,) and 2-D (N, K) tensors are served")
    if tensor.WhichOneof("encoding") == "sparse_csr":
        return _dense_rows(tensor.sparse_csr, typecode, shape, where)
    values = _numbers(tensor.dense, typecode, where)
    if len(shape) < 2:  # (N,), or no shape sent: the SDK then means one value per position
        if shape and shape[0] != len(values):
            raise WireError(f"{where}: shape {shape} but {len(values)} values")
        return values
    n, k = shape
    if n * k != len(values):
        raise WireError(f"{where}: shape {shape} but {len(values)} values")
    return [values[r * k:(r + 1) * k] for r in range(n)]


def _dense_rows(csr, typecode: str, shape: list[int], where: str) -> list[list]:
    if len(shape) != 2:
        raise WireError(f"{where}: a sparse CSR tensor needs a 2-D shape, got {shape}")
    n, k = shape
    values = _numbers(csr.values, typecode, f"{where}.values")
    crow = _numbers(csr.crow_indices, _INT64, f"{where}.crow_indices")
    col = _numbers(csr.col_indices, _INT64, f"{where}.col_indices")
    if (len(crow) != n + 1 or crow[0] != 0 or crow[-1] != len(values) or len(col) != len(values)
            or any(b < a for a, b in zip(crow, crow[1:])) or any(not 0 <= c < k for c in col)):
        raise WireError(f"{where}: the sparse CSR indices do not describe a {n}x{k} tensor of {len(values)} values")
    pad = 0 if typecode == _INT64 else 0.0
    rows = [[pad] * k for _ in range(n)]
    for r in range(n):
        for j in range(crow[r], crow[r + 1]):
            rows[r][col[j]] = values[j]
    return rows


def _numbers(raw: bytes, typecode: str, where: str) -> list:
    values = array(typecode)
    if len(raw) % values.itemsize:
        raise WireError(f"{where}: {len(raw)} bytes is not a whole number of {values.itemsize}-byte values")
    values.frombytes(raw)
    if _SWAP:
        values.byteswap()
    return values.tolist()


def _to_bytes(values: array) -> bytes:
    if _SWAP:
        values = array(values.typecode, values)
        values.byteswap()
    return values.tobytes()


def _runs_by_trailing_shape(per_datum: Sequence[Sequence]) -> list[tuple[list[int], list[list[float]]]]:
    """Consecutive datums grouped by trailing shape ([] for one value per position, [K] for rows of K), each datum's
    values flattened row by row."""
    runs: list[tuple[list[int], list[list[float]]]] = []
    for i, values in enumerate(per_datum):
        rows = [v for v in values if isinstance(v, Sequence)]
        if rows and len(rows) != len(values):
            raise WireError(f"logprobs[{i}]: numbers and rows mixed")
        trailing = [len(rows[0])] if rows else []
        if rows and any(len(row) != trailing[0] for row in rows):
            raise WireError(f"logprobs[{i}]: rows of different lengths")
        flat = [float(x) for row in rows for x in row] if rows else [float(x) for x in values]
        if runs and runs[-1][0] == trailing:
            runs[-1][1].append(flat)
        else:
            runs.append((trailing, [flat]))
    return runs
