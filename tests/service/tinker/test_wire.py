"""The Tinker wire codec against the SDK itself: requests are written by the SDK's own client (tinker.AsyncTinker's
resources, over HTTP to a loopback server that keeps the bodies) and read by service/tinker/wire.py; results are
written by wire.py and read by the function the SDK applies to a retrieve_future protobuf reply
(tinker.proto.response_conv.deserialize_proto_response)."""

from __future__ import annotations

import asyncio
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("tinker")

from tinker import types  # noqa: E402
from tinker._client import AsyncTinker  # noqa: E402  (the HTTP client under the SDK's public classes)
from tinker.lib.chunked_fwdbwd_helpers import combine_fwd_bwd_output_results  # noqa: E402
from tinker.proto import tinker_public_pb2 as sdk_pb  # noqa: E402
from tinker.proto.response_conv import deserialize_proto_response  # noqa: E402

from service.tinker import wire  # noqa: E402
from service.tinker.wire import WireError  # noqa: E402
from tests.loopback_http import QuietHandler, base_url, serving  # noqa: E402

REPO = Path(__file__).resolve().parents[3]


class Keeper(QuietHandler):
    """Keeps each POST (path, content type, body) and answers as the service does on a submission: a future."""

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.kept.append((self.path, self.headers.get("Content-Type"), body))
        self.answer(200, json.dumps({"request_id": "req-1", "sample_sequence_ids": ["s-1"]}).encode())


@pytest.fixture(scope="module")
def sdk():
    """Sends one request through the SDK's own resource method and gives back what arrived."""
    with serving(Keeper) as server:
        server.kept = []

        def send(resource: str, method: str, **kwargs):
            async def call():
                client = AsyncTinker(api_key="tml-wire-test", base_url=base_url(server), max_retries=0)
                try:
                    await getattr(getattr(client, resource), method)(**kwargs)
                finally:
                    await client.close()

            server.kept.clear()
            asyncio.run(call())
            [kept] = server.kept
            return kept

        yield send


def _forward_backward(sdk, data, loss_fn, loss_fn_config=None, *, forward_only=False, seq_id=3):
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn, loss_fn_config=loss_fn_config),
        model_id="sess-1:train:0", seq_id=seq_id)
    path, content_type, body = sdk("training", "forward_backward", request=request, forward_only=forward_only)
    assert (path, content_type) == ("/api/v1/forward_backward", wire.PROTOBUF_CONTENT_TYPE)
    return body


def test_a_cross_entropy_request_reads_back_as_its_tokens_targets_and_weights(sdk):
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([11, 12, 13]).append_int(14),  # two text chunks
        loss_fn_inputs={"target_tokens": [12, 13, 14, 15], "weights": [0.0, 1.0, 0.5, 1.0]})
    other = types.Datum(model_input=types.ModelInput.from_ints([7, 8]),
                        loss_fn_inputs={"target_tokens": [8, 9], "weights": [1.0, 0.25]})

    call = wire.decode_forward_backward(_forward_backward(sdk, [datum, other], "cross_entropy", seq_id=7))

    assert (call.model_id, call.seq_id, call.forward_only, call.loss_fn, call.loss_fn_config) == \
        ("sess-1:train:0", 7, False, "cross_entropy", {})
    assert call.datums == [
        wire.WireDatum(tokens=[11, 12, 13, 14],
                       inputs={"target_tokens": [12, 13, 14, 15], "weights": [0.0, 1.0, 0.5, 1.0]}),
        wire.WireDatum(tokens=[7, 8], inputs={"target_tokens": [8, 9], "weights": [1.0, 0.25]}),
    ]
    assert all(type(t) is int for t in call.datums[0].inputs["target_tokens"])


def test_forward_is_the_same_request_with_forward_only_and_its_config_numbers(sdk):
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                        loss_fn_inputs={"target_tokens": [2, 3, 4], "logprobs": [-0.5, -1.25, -2.0],
                                        "advantages": [0.0, 1.5, -1.5]})

    call = wire.decode_forward_backward(_forward_backward(
        sdk, [datum], "ppo", {"clip_low_threshold": 0.75, "clip_high_threshold": 1.25}, forward_only=True))

    assert call.forward_only and call.loss_fn == "ppo"
    assert call.loss_fn_config == {"clip_low_threshold": 0.75, "clip_high_threshold": 1.25}
    assert call.datums[0].inputs == {"target_tokens": [2, 3, 4], "logprobs": [-0.5, -1.25, -2.0],
                                     "advantages": [0.0, 1.5, -1.5]}


def test_two_dimensional_targets_read_back_as_k_values_per_position_sparse_or_dense(sdk):
    torch = pytest.importorskip("torch")
    # top-K distillation's shape: (N, K) target tokens and weights, most positions without targets
    targets = torch.zeros(5, 3, dtype=torch.long)
    weights = torch.zeros(5, 3)
    targets[3] = torch.tensor([40, 41, 42])
    weights[3] = torch.tensor([0.5, 0.25, 0.25])
    targets[4, 1] = 43
    weights[4, 1] = 1.0
    sparse = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3, 4, 5]),
                         loss_fn_inputs={"target_tokens": targets, "weights": weights})
    dense = types.Datum(model_input=types.ModelInput.from_ints([6, 7]),
                        loss_fn_inputs={"target_tokens": types.TensorData.from_torch(torch.tensor([[7, 8], [8, 9]])),
                                        "weights": types.TensorData.from_torch(torch.tensor([[1.0, 0.5], [0.5, 1.0]]))})
    body = _forward_backward(sdk, [sparse, dense], "cross_entropy")
    sent = sdk_pb.ForwardBackwardRequest.FromString(body)
    assert [sent.data[0].loss_fn_inputs[k].WhichOneof("encoding") for k in ("target_tokens", "weights")] == \
        ["sparse_csr", "sparse_csr"]  # the SDK chose CSR: the test reads the sparse path
    assert sent.data[1].loss_fn_inputs["weights"].WhichOneof("encoding") == "dense"

    first, second = wire.decode_forward_backward(body).datums

    assert first.inputs["target_tokens"] == [[0, 0, 0], [0, 0, 0], [0, 0, 0], [40, 41, 42], [0, 43, 0]]
    assert first.inputs["weights"] == [[0.0] * 3, [0.0] * 3, [0.0] * 3, [0.5, 0.25, 0.25], [0.0, 1.0, 0.0]]
    assert second.inputs == {"target_tokens": [[7, 8], [8, 9]], "weights": [[1.0, 0.5], [0.5, 1.0]]}


def test_what_the_service_cannot_serve_is_refused_naming_the_field(sdk):
    image = types.Datum(
        model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1]),
                                             types.ImageChunk(data=b"\x89PNG", format="png")]),
        loss_fn_inputs={"target_tokens": [2, 3]})
    with pytest.raises(WireError, match=r"data\[0\]\.model_input\[1\]: image chunks"):
        wire.decode_forward_backward(_forward_backward(sdk, [image], "cross_entropy"))

    text = types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3]})
    with pytest.raises(WireError, match=r"loss_fn_config\['mode'\]"):
        wire.decode_forward_backward(_forward_backward(sdk, [text], "cross_entropy", {"mode": "x"}))

    short = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0]})
    with pytest.raises(WireError, match=r"data\[0\]\.loss_fn_inputs\['weights'\]: 2 positions for 3"):
        wire.decode_forward_backward(_forward_backward(sdk, [short], "cross_entropy"))

    # a dtype the public SDK never writes (its wire is float32 and int64)
    request = sdk_pb.ForwardBackwardRequest.FromString(_forward_backward(sdk, [text], "cross_entropy"))
    request.data[0].loss_fn_inputs["weights"].CopyFrom(
        sdk_pb.Tensor(dtype=sdk_pb.DTYPE_BFLOAT16, dense=b"\x80\x3f\x80\x3f", shape=[2]))
    with pytest.raises(WireError, match=r"data\[0\]\.loss_fn_inputs\['weights'\]: dtype DTYPE_BFLOAT16"):
        wire.decode_forward_backward(request.SerializeToString())

    with pytest.raises(WireError, match="not a ForwardBackwardRequest"):
        wire.decode_forward_backward(b"\xff\xff\xff")


def test_a_forward_backward_result_reads_back_in_the_sdk_with_its_logprobs_and_metrics():
    logprobs = [[-0.5, -1.0, -0.25], [-2.0], [[-0.5, -1.5], [-0.25, -4.0]]]  # the last: an (N, K) target's
    metrics = {"loss:sum": 3.75, "tokens:sum": 6.0, "clipped_fraction:mean": 0.5}

    result = deserialize_proto_response(wire.encode_forward_backward(logprobs, metrics), types.ForwardBackwardOutput)

    assert result.loss_fn_output_type == "ArrayRecord"
    assert [out["logprobs"].tolist() for out in result.loss_fn_outputs] == logprobs
    assert [out["logprobs"].shape for out in result.loss_fn_outputs] == [[3], [1], [2, 2]]
    assert {out["logprobs"].dtype for out in result.loss_fn_outputs} == {"float32"}
    assert result.metrics == metrics
    # a batch the SDK sent in two requests: their results combine by each metric's reduction
    combined = combine_fwd_bwd_output_results([result, result])
    assert combined.metrics == {"loss:sum": 7.5, "tokens:sum": 12.0, "clipped_fraction:mean": 0.5}
    assert len(combined.loss_fn_outputs) == 6

    empty = deserialize_proto_response(wire.encode_forward_backward([], {}), types.ForwardBackwardOutput)
    assert (empty.loss_fn_outputs, empty.metrics) == ([], {})


def test_a_metric_key_the_sdk_cannot_combine_is_refused():
    for key in ("loss", "loss:sum:x", "loss:median"):
        with pytest.raises(WireError, match=re.escape(f"metrics[{key!r}]")):
            wire.encode_forward_backward([[-1.0]], {key: 1.0})


def test_a_sample_result_reads_back_in_the_sdk_with_stop_reasons_and_prompt_logprobs():
    sequences = [([5, 6, 7], [-0.5, -0.25, -1.0], "stop"), ([8], [-2.0], "length")]

    response = deserialize_proto_response(wire.encode_sample(sequences, [None, -1.5, -0.75]), types.SampleResponse)

    assert [(s.tokens, s.logprobs, s.stop_reason) for s in response.sequences] == \
        [([5, 6, 7], [-0.5, -0.25, -1.0], "stop"), ([8], [-2.0], "length")]
    assert response.prompt_logprobs == [None, -1.5, -0.75]
    assert math.isnan(response.prompt_logprobs_np[0])

    unasked = deserialize_proto_response(wire.encode_sample(sequences[:1], None), types.SampleResponse)
    assert unasked.prompt_logprobs is None
    with pytest.raises(WireError, match=r"sequences\[0\]\.stop_reason: 'eos'"):
        wire.encode_sample([([1], [-1.0], "eos")], None)


def test_a_sample_request_s_json_prompt_reads_back_as_its_tokens(sdk):
    prompt = types.ModelInput.from_ints([1, 2, 3]).append_int(4)
    request = types.SampleRequest(sampling_session_id="sess-1:sample:0", seq_id=1, num_samples=1, prompt=prompt,
                                  sampling_params=types.SamplingParams(max_tokens=4), prompt_logprobs=True)
    path, _, body = sdk("sampling", "asample", request=request)
    assert path == "/api/v1/asample"
    assert wire.model_input_tokens(json.loads(body)["prompt"]) == [1, 2, 3, 4]

    with pytest.raises(WireError, match=r"prompt\.chunks\[1\]: 'image' chunks"):
        wire.model_input_tokens({"chunks": [{"type": "encoded_text", "tokens": [1]},
                                            {"type": "image", "data": "", "format": "png"}]})
    with pytest.raises(WireError, match=r"prompt\.chunks\[0\]\.tokens"):
        wire.model_input_tokens({"chunks": [{"type": "encoded_text", "tokens": ["a"]}]})


def test_the_codec_loads_the_sdk_s_schema_without_the_sdk_or_torch():
    """The API never loads torch, and the SDK's package imports it where installed: the codec reads the schema file
    alone, and a process that imports the SDK afterwards shares its message classes."""
    code = ("import sys, service.tinker.wire as w; "
            "assert 'torch' not in sys.modules and 'tinker' not in sys.modules, 'loaded the SDK'; "
            "from tinker.proto import tinker_public_pb2 as p; "
            "assert p.ForwardBackwardRequest is w.pb.ForwardBackwardRequest")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
