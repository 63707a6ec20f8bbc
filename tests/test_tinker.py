"""``creditrl serve-tinker``: the unmodified ``tinker`` SDK drives every supported call against
the local service (tiny random model, real tokenizer); the numbers are creditrl's own (losses,
log-probs, sampled log-probs = training forward); bad requests are 4xx answers, never a crash;
``creditrl report`` and ``creditrl explain`` read what a client did."""

from __future__ import annotations

import math
import socket

import pytest
import torch

from creditrl.cli import main
from creditrl.core.policy_losses import PolicyLossConfig, get_policy_loss
from creditrl.models.tiny import tiny_model_dir
from creditrl.tinker.messages import Limits, encode_sample_response, parse_forward_backward
from creditrl.tinker.server import TinkerServer
from creditrl.tinker.service import Settings
from creditrl.tinker.wire import bytes_field, read_fields, varint_field

tinker = pytest.importorskip("tinker", reason="the tinker SDK is the extra creditrl[tinker]")
httpx = pytest.importorskip("httpx", reason="httpx comes with the tinker SDK")
types = tinker.types


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    out = tmp_path_factory.mktemp("tinker")
    srv = TinkerServer(Settings(out_dir=out, max_sessions=4, max_models=3))
    srv.start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server: TinkerServer, monkeypatch_module):
    monkeypatch_module.setenv("TINKER_BASE_URL", server.base_url)
    monkeypatch_module.setenv("TINKER_API_KEY", "tml-local")
    service_client = tinker.ServiceClient()
    yield service_client
    service_client.close("success")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def trainer(client):
    return client.create_lora_training_client(base_model=str(tiny_model_dir()), rank=4).result()


def _datum(tokens: list[int], **inputs) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], **inputs},
    )


def _reference_log_probs(server: TinkerServer, model_id: str, tokens: list[int]) -> torch.Tensor:
    """log π(x_t | x_<t), t >= 1, from the served module's plain logits (no creditrl code)."""
    module = server.service.policies[model_id].module
    with torch.no_grad():
        logits = module(input_ids=torch.tensor([tokens])).logits[0, :-1].float()
    return logits.log_softmax(-1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]


def test_sdk_drives_every_supported_call(server: TinkerServer, client, trainer) -> None:
    names = [m.model_name for m in client.get_server_capabilities().supported_models]
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in names
    info = trainer.get_info()
    assert info.lora_rank == 4 and info.is_lora
    tokenizer = trainer.get_tokenizer()
    tokens = tokenizer.encode("The quick brown fox jumps over the lazy dog")
    n = len(tokens) - 1

    forward = trainer.forward([_datum(tokens)], "cross_entropy").result()
    logprobs = torch.tensor(forward.loss_fn_outputs[0]["logprobs"].tolist())
    expected = _reference_log_probs(server, trainer.model_id, tokens)
    assert torch.allclose(logprobs, expected, atol=1e-4)
    assert forward.metrics["loss:sum"] == pytest.approx(-float(expected.sum()), rel=1e-4)

    weights = [0.0] * 3 + [1.0] * (n - 3)
    out = trainer.forward([_datum(tokens, weights=weights)], "cross_entropy").result()
    assert out.metrics["loss:sum"] == pytest.approx(-float(expected[3:].sum()), rel=1e-4)

    sampled = (expected - 0.1).tolist()
    advantages = [0.5 if i % 2 else -1.0 for i in range(n)]
    for loss_fn, policy_loss, config, cfg in [
        ("importance_sampling", "ppo", None, PolicyLossConfig(clip_ratio=1e30, clip_ratio_c=1e30)),
        (
            "ppo",
            "ppo",
            {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05},
            PolicyLossConfig(clip_ratio_low=0.1, clip_ratio_high=0.05, clip_ratio_c=1e30),
        ),
        (
            "cispo",
            "cispo",
            None,
            PolicyLossConfig(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=1e30),
        ),
    ]:
        datum = _datum(tokens, logprobs=sampled, advantages=advantages)
        result = trainer.forward([datum], loss_fn, config).result()
        loss, _ = get_policy_loss(policy_loss)(
            torch.tensor([sampled]),
            expected[None],
            torch.tensor([advantages]),
            torch.ones(1, n),
            "token-sum",
            cfg,
        )
        assert result.metrics["loss:sum"] == pytest.approx(float(loss), rel=1e-4, abs=1e-5)

    before = {
        k: v.clone() for k, v in server.service.policies[trainer.model_id].adapter_state().items()
    }
    fb = trainer.forward_backward([_datum(tokens, weights=[1.0] * n)], "cross_entropy")
    step = trainer.optim_step(types.AdamParams(learning_rate=1e-2, beta1=0.8, eps=1e-8))
    assert fb.result().metrics["loss:sum"] > 0
    assert step.result().metrics["learning_rate:mean"] == pytest.approx(1e-2)
    after = server.service.policies[trainer.model_id].adapter_state()
    assert any(not torch.equal(before[k], after[k]) for k in before)

    sampler = trainer.save_weights_and_get_sampling_client()
    prompt = tokens[:4]
    response = sampler.sample(
        types.ModelInput.from_ints(prompt),
        num_samples=3,
        sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=3),
    ).result()
    assert len(response.sequences) == 3
    for seq in response.sequences:
        assert 1 <= len(seq.tokens) <= 6 and len(seq.logprobs) == len(seq.tokens)
        full = prompt + list(seq.tokens)
        train = _reference_log_probs(server, trainer.model_id, full)[len(prompt) - 1 :]
        assert torch.allclose(torch.tensor(seq.logprobs), train, atol=1e-4)

    stop_token = response.sequences[0].tokens[0]
    stopped = (
        sampler.sample(
            types.ModelInput.from_ints(prompt),
            num_samples=1,
            sampling_params=types.SamplingParams(max_tokens=6, seed=3, stop=[stop_token]),
        )
        .result()
        .sequences[0]
    )
    assert stopped.tokens == [stop_token] and stopped.stop_reason == "stop"
    text = tokenizer.decode(response.sequences[1].tokens[:2])
    by_text = (
        sampler.sample(
            types.ModelInput.from_ints(prompt),
            num_samples=3,
            sampling_params=types.SamplingParams(max_tokens=6, seed=3, stop=text),
        )
        .result()
        .sequences[1]
    )
    assert text in tokenizer.decode(by_text.tokens) and by_text.stop_reason == "stop"

    scored = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    reference = _reference_log_probs(server, trainer.model_id, tokens)
    assert scored[0] is None
    assert torch.allclose(torch.tensor(scored[1:]), reference, atol=1e-4)

    state = trainer.save_state("first").result().path
    sampler_path = trainer.save_weights_for_sampler("first").result().path
    listed = tinker.RestClient().list_checkpoints(trainer.model_id).result().checkpoints
    assert {c.tinker_path for c in listed} == {state, sampler_path}
    restored = client.create_training_client_from_state_with_optimizer(state).result()
    again = restored.forward([_datum(tokens)], "cross_entropy").result()
    now = trainer.forward([_datum(tokens)], "cross_entropy").result()
    assert again.loss_fn_outputs[0]["logprobs"].tolist() == pytest.approx(
        now.loss_fn_outputs[0]["logprobs"].tolist(), abs=1e-5
    )
    from_path = client.create_sampling_client(model_path=sampler_path)
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0)
    a = from_path.sample(types.ModelInput.from_ints(prompt), 1, greedy).result()
    b = sampler.sample(types.ModelInput.from_ints(prompt), 1, greedy).result()
    assert a.sequences[0].tokens == b.sequences[0].tokens


def test_a_sampler_of_an_unchanged_version_reuses_its_snapshot_and_merge(
    server: TinkerServer, trainer
) -> None:
    policy = server.service.policies[trainer.model_id]
    tokens = trainer.get_tokenizer().encode("one two three four five")
    prompt = types.ModelInput.from_ints(tokens)
    params = types.SamplingParams(max_tokens=3, temperature=1.0, seed=1)

    def samplers():
        return [s for s in server.service.samplers.values() if s.model_id == trainer.model_id]

    trainer.save_weights_and_get_sampling_client().sample(prompt, 1, params).result()
    merges, first = policy.merged.merges, samplers()[-1]
    trainer.save_weights_and_get_sampling_client().sample(prompt, 1, params).result()
    second = samplers()[-1]
    assert second is not first and second.version == first.version
    assert second.adapters is first.adapters  # the version's snapshot, not a new copy
    assert policy.merged.merges == merges  # and not merged again
    n = len(tokens) - 1
    trainer.forward_backward([_datum(tokens, weights=[1.0] * n)], "cross_entropy").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    trainer.save_weights_and_get_sampling_client().sample(prompt, 1, params).result()
    third = samplers()[-1]
    assert third.version > second.version and third.adapters is not second.adapters
    assert any(not torch.equal(third.adapters[k], v) for k, v in second.adapters.items())
    assert policy.merged.merges == merges + 1  # one merge per weight change


def test_concurrent_sampling_requests_are_sampled_in_one_engine_call(
    server: TinkerServer, trainer, monkeypatch
) -> None:
    import creditrl.tinker.service as service_module

    # a quiet window far longer than the client needs to send its requests
    monkeypatch.setattr(service_module, "GATHER_QUIET_S", 1.0)
    monkeypatch.setattr(service_module, "GATHER_MAX_S", 10.0)
    policy = server.service.policies[trainer.model_id]
    calls: list[int] = []
    sample = policy.sample

    def counting(requests, params):
        calls.append(len(requests))
        return sample(requests, params)

    monkeypatch.setattr(policy, "sample", counting)
    sampler = trainer.save_weights_and_get_sampling_client()
    params = types.SamplingParams(max_tokens=2, temperature=1.0)
    futures = [
        sampler.sample(types.ModelInput.from_ints([5, 6, 7 + i]), 1, params) for i in range(6)
    ]
    assert all(len(f.result().sequences) == 1 for f in futures)
    assert calls == [6]


def test_unsupported_calls_get_the_sdks_error_with_a_message(trainer) -> None:
    tokens = [1, 2, 3, 4]
    with pytest.raises(tinker.RequestFailedError, match=r"server-side custom losses are not"):
        trainer.forward([_datum(tokens)], "custom").result()
    with pytest.raises(tinker.BadRequestError, match="not supported"):
        trainer.save_weights_external("x").result()
    with pytest.raises(tinker.RequestFailedError, match="lacks loss_fn_inputs"):
        trainer.forward([_datum(tokens)], "ppo").result()


def _post(server: TinkerServer, path: str, **kwargs) -> httpx.Response:
    headers = {"X-API-Key": "tml-local", **kwargs.pop("headers", {})}
    return httpx.post(f"{server.base_url}/api/v1/{path}", headers=headers, timeout=30, **kwargs)


def test_bad_requests_are_4xx_and_the_service_goes_on(server: TinkerServer, trainer) -> None:
    proto = {"Content-Type": "application/x-protobuf"}
    answers = [
        _post(server, "create_model", content=b"{not json"),
        _post(server, "create_model", json=[1, 2]),
        _post(server, "create_model", json={"session_id": "nope", "base_model": "x"}),
        _post(server, "forward_backward", content=b"\xff\xff\xff", headers=proto),
        _post(server, "forward_backward", content=b"{}", headers={"Content-Type": "text/plain"}),
        _post(server, "optim_step", json={"model_id": "nope", "adam_params": {}}),
        _post(server, "asample", json={"sampling_session_id": 3}),
        _post(server, "retrieve_future", json={"request_id": "unknown"}),
        _post(server, "no_such_call", json={}),
        _post(server, "create_model", content=b"x" * (33 << 20)),
    ]
    for answer in answers:
        assert 400 <= answer.status_code < 500, answer.text
        assert "detail" in answer.json()
    huge = bytes_field(1, trainer.model_id) + bytes_field(4, "cross_entropy")
    huge += b"".join(bytes_field(3, b"") for _ in range(Limits().max_datums + 1))
    assert _post(server, "forward_backward", content=huge, headers=proto).status_code == 400
    assert httpx.get(f"{server.base_url}/api/v1/healthz").json() == {"status": "ok"}


def test_a_client_that_disconnects_leaves_the_service_running(server: TinkerServer) -> None:
    head = (
        "POST /api/v1/retrieve_future HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        'Content-Length: 1000\r\n\r\n{"request_id":'
    )
    with socket.create_connection((server.host, server.port)) as sock:
        sock.sendall(head.encode())
    assert httpx.get(f"{server.base_url}/api/v1/healthz").json() == {"status": "ok"}


def test_report_and_explain_read_what_a_client_did(
    server: TinkerServer, trainer, capsys: pytest.CaptureFixture
) -> None:
    tokens = [1, 30, 31, 32, 33, 34]
    datum = _datum(tokens, logprobs=[-1.0] * 5, advantages=[0, 0, 1.0, 1.0, 1.0])
    trainer.forward_backward([datum], "importance_sampling").result()
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    run = server.settings.out_dir / "runs" / trainer.model_id.replace(":", "-")
    assert (run / "metrics.jsonl").is_file() and list((run / "rollouts").glob("*.jsonl"))
    assert main(["report", str(run), "--no-png"]) == 0
    assert main(["explain", str(run), "--tsv"]) == 0
    out = capsys.readouterr().out
    assert "advantage" in out


def test_wire_messages_round_trip() -> None:
    tensor = bytes_field(1, torch.tensor([5, 6], dtype=torch.int64).numpy().tobytes())
    tensor += varint_field(3, 2) + bytes_field(4, b"\x02")  # dtype int64, packed shape [2]
    chunk = bytes_field(
        1, bytes_field(1, torch.tensor([7, 8], dtype=torch.int32).numpy().tobytes())
    )
    datum = bytes_field(1, chunk) + bytes_field(
        2, bytes_field(1, "target_tokens") + bytes_field(2, tensor)
    )
    body = (
        bytes_field(1, "m")
        + varint_field(2, 1)
        + bytes_field(3, datum)
        + bytes_field(4, "cross_entropy")
    )
    request = parse_forward_backward(body, Limits())
    assert request.data[0].tokens == [7, 8]
    assert request.data[0].inputs["target_tokens"].tolist() == [5, 6]
    from creditrl.tinker.messages import SampledSequence

    fields = read_fields(
        encode_sample_response([SampledSequence([1], [-0.5], "stop")], [math.nan]), 8
    )
    assert len(fields[1]) == 1 and len(fields[2][0]) == 4
