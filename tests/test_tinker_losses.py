"""The Tinker losses beyond the first four, each pinned to its definition on numbers worked out
by hand: ``gspo`` (GSPO-token with ``sequence_ratio_mask``), ``dro``, ``stable_reinforce`` (the
sampling-time records, the datums' provenance, creditrl's truncated-weight objective), and
``forward_backward_custom`` served over ``cross_entropy``; what stays unsupported is one line in
the SDK's own error."""

from __future__ import annotations

import math

import pytest
import torch

from creditrl.core.policy_losses import PolicyLossConfig, compute_policy_loss_gspo
from creditrl.models.tiny import tiny_model_dir
from creditrl.tinker.losses import check_loss, tinker_loss
from creditrl.tinker.messages import (
    BadRequest,
    Datum,
    Limits,
    SampledSequence,
    Span,
    parse_forward_backward,
)
from creditrl.tinker.stability import StabilityRecords
from creditrl.tinker.wire import bytes_field, varint_field

LP = [-1.0, -0.5, -2.0, -0.2]  # the trainer's log-probs of four targets
Q = [0.0, -0.7, -1.5, -1.2]  # the sampler's (position 0: a prompt position, padded with 0)


def _loss(name: str, config: dict, inputs: dict, lp: list[float] = LP):
    """tinker_loss on one datum; returns (loss, metrics, trained, gradient wrt the log-probs)."""
    log_prob = torch.tensor([lp], requires_grad=True)
    padded = {k: torch.tensor([v], dtype=torch.float32) for k, v in inputs.items()}
    loss, metrics, trained = tinker_loss(name, config, log_prob, padded, torch.ones(1, len(lp)))
    loss.backward()
    return float(loss), metrics, trained, log_prob.grad[0].tolist()


def test_gspo_is_gspo_token_over_the_sequence_ratio_mask() -> None:
    advantages = [0.0, 1.0, 1.0, -0.5]
    # sequence ratio over positions 1 and 2 only: log s = ((-0.5 + 0.7) + (-2.0 + 1.5)) / 2
    s = math.exp((0.2 - 0.5) / 2)  # 0.8607, inside [0.8, 1.2]
    inputs = {"logprobs": Q, "advantages": advantages, "sequence_ratio_mask": [0, 1, 1, 0]}
    loss, metrics, trained, grad = _loss("gspo", {}, inputs)
    # every trained token carries s (position 3 too, though outside the mask): -s (1 + 1 - 0.5)
    assert loss == pytest.approx(-1.5 * s, rel=1e-6)
    assert grad == pytest.approx([0.0, -s, -s, 0.5 * s], rel=1e-6)
    assert trained == 3 and metrics["tokens:sum"] == 3 and metrics["pg_clipfrac:mean"] == 0

    # the clip: s = exp(0.2) = 1.2214 > 1.1; A > 0 takes the flat clipped branch (no gradient),
    # A < 0 keeps min(s A, 1.1 A) = s A
    inputs = {
        "logprobs": Q,
        "advantages": [0.0, 1.0, 0.0, -1.0],
        "sequence_ratio_mask": [0, 1, 0, 0],
    }
    config = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    loss, metrics, _, grad = _loss("gspo", config, inputs)
    s = math.exp(0.2)
    assert loss == pytest.approx(-(1.1 * 1.0) + s, rel=1e-6)
    assert grad == pytest.approx([0.0, 0.0, 0.0, s], rel=1e-6)
    assert metrics["pg_clipfrac:mean"] == pytest.approx(0.5)

    # without sequence_ratio_mask the ratio averages over the positions trained on
    inputs = {"logprobs": Q, "advantages": [0.0, 1.0, 1.0, 0.0]}
    loss, *_ = _loss("gspo", {}, inputs)
    assert loss == pytest.approx(-2 * math.exp((0.2 - 0.5) / 2), rel=1e-6)


def test_core_gspo_ratio_mask_defaults_to_the_response_mask() -> None:
    old = torch.tensor([[-0.7, -1.5, -0.4]])
    new = torch.tensor([[-0.5, -2.0, -0.3]])
    adv, mask = torch.tensor([[1.0, -0.5, 0.5]]), torch.tensor([[1.0, 1.0, 0.0]])
    cfg = PolicyLossConfig()
    plain, _ = compute_policy_loss_gspo(old, new, adv, mask, "token-sum", cfg)
    same, _ = compute_policy_loss_gspo(old, new, adv, mask, "token-sum", cfg, ratio_mask=mask)
    assert float(plain) == float(same)
    # the ratio over positions 0 and 2 (2 is not trained): s = exp(0.15) for both trained tokens
    wide, _ = compute_policy_loss_gspo(
        old, new, adv, mask, "token-sum", cfg, ratio_mask=torch.tensor([[1.0, 0.0, 1.0]])
    )
    assert float(wide) == pytest.approx(-0.5 * math.exp(0.15), rel=1e-6)


def test_dro_is_reinforce_with_a_quadratic_penalty_on_every_position() -> None:
    advantages = [0.0, 1.0, -1.0, 0.0]
    # l = -sum A lp + (beta / 2) sum (lp - q)^2; position 0's q = 0 counts in the penalty
    square = 1.0 + 0.2**2 + 0.5**2 + 1.0**2
    loss, metrics, trained, grad = _loss(
        "dro", {"beta": 0.1}, {"logprobs": Q, "advantages": advantages}
    )
    assert loss == pytest.approx(-(-0.5 + 2.0) + 0.05 * square, rel=1e-6)
    assert grad == pytest.approx([-0.1, -1.0 + 0.02, 1.0 - 0.05, 0.1], rel=1e-5)
    assert trained == 4 and metrics["loss:sum"] == pytest.approx(loss)
    default, *_ = _loss("dro", {}, {"logprobs": Q, "advantages": advantages})
    assert default == pytest.approx(-1.5 + 0.025 * square, rel=1e-6)  # beta 0.05


def test_stable_reinforce_weights_reinforce_by_the_truncated_recorded_ratio() -> None:
    # recorded q: ratios exp(0.2) = 1.2214, exp(-0.5) = 0.6065, exp(1.0) = 2.718 -> 2 (truncated)
    w = [math.exp(0.2), math.exp(-0.5), 2.0]
    inputs = {"recorded": Q, "advantages": [0.0, 1.0, 1.0, -1.0]}
    loss, metrics, trained, grad = _loss("stable_reinforce", {}, inputs)
    assert loss == pytest.approx(-(w[0] * -0.5 + w[1] * -2.0 - w[2] * -0.2), rel=1e-5)
    assert grad == pytest.approx([0.0, -w[0], -w[1], w[2]], rel=1e-5)
    assert trained == 3 and metrics["pg_clipfrac:mean"] == pytest.approx(1 / 3)
    # the client's logprobs are not what it reads: the recorded ones are
    inputs["logprobs"] = [0.0, 0.0, 0.0, 0.0]
    assert _loss("stable_reinforce", {}, inputs)[0] == pytest.approx(loss)
    # nothing trained: zero loss, no error
    nothing = {"recorded": Q, "advantages": [0.0] * 4}
    assert _loss("stable_reinforce", {}, nothing)[0] == 0.0


@pytest.mark.parametrize(
    ("name", "config", "message"),
    [
        ("dro", {"clip_low_threshold": 0.9}, "takes no config key"),
        ("dro", {"beta": -1.0}, "finite beta >= 0"),
        ("gspo", {"clip_low_threshold": 1.5}, "clip_low_threshold <= 1"),
        ("stable_reinforce", {"kl_coeff": 0.01}, "kl_coeff term is not served"),
        ("custom", {}, "server-side custom losses are not supported"),
        ("nope", {}, "not supported by this local service; supported: cross_entropy"),
    ],
)
def test_bad_loss_configs_are_one_line(name: str, config: dict, message: str) -> None:
    with pytest.raises(BadRequest, match=message):
        check_loss(name, config)
    assert check_loss("stable_reinforce", {"kl_coeff": 0.0}).provenance


def _records(now: float = 1000.0) -> StabilityRecords:
    records = StabilityRecords(max_tokens=40, ttl_s=100.0)
    sequences = [
        SampledSequence([7, 8, 9], [-0.1, -0.2, -0.3], "stop"),
        SampledSequence([5], [-1.5], "length"),
    ]
    records.add("s1", ["a", "b"], [1, 2, 3], sequences, now=now)
    return records


def _provenanced(
    tokens: list[int], targets: list[int], input_spans, target_spans, **inputs
) -> Datum:
    values = {"target_tokens": torch.tensor(targets)}
    values.update({k: torch.tensor(v, dtype=torch.float32) for k, v in inputs.items()})
    return Datum(tokens, values, input_spans, target_spans)


def _rl_datum(advantages: list[float]) -> Datum:
    """Prompt [1, 2, 3] + sampled [7, 8, 9], laid out as the cookbook's rl_loop lays it out."""
    return _provenanced(
        [1, 2, 3, 7, 8],
        [2, 3, 7, 8, 9],
        [Span("prompt", "a", 0, 3), Span("sampled", "a", 0, 2)],
        [Span("prompt", "a", 1, 2), Span("sampled", "a", 0, 3)],
        advantages=advantages,
    )


def test_records_resolve_provenance_against_what_was_sampled() -> None:
    records = _records()
    datum = _rl_datum([0, 0, 1, 1, 1])
    records.attach("s1", [datum], now=1050.0)
    assert datum.recorded.tolist() == pytest.approx([0.0, 0.0, -0.1, -0.2, -0.3])

    cases = [
        ("s2", _rl_datum([0, 0, 1, 1, 1]), "has not sampled with record_stability_info"),
        ("s1", _rl_datum([0, 1, 1, 1, 1]), "position 1 has an advantage but its target is not"),
        ("s1", Datum([1, 2], {"target_tokens": torch.tensor([2, 3])}), "has no provenance"),
    ]
    wrong = _rl_datum([0, 0, 1, 1, 1])
    wrong.inputs["target_tokens"] = torch.tensor([2, 3, 7, 4, 9])
    cases.append(("s1", wrong, "position 3 holds token 4 but sampled token 1 of sequence 'a' is 8"))
    past = _rl_datum([0, 0, 1, 1, 1])
    past.target_spans = [Span("prompt", "a", 1, 2), Span("sampled", "a", 1, 3)]
    cases.append(("s1", past, "reaches position 4, past its 3 sampled tokens"))
    for session, datum, message in cases:
        with pytest.raises(BadRequest, match=message):
            records.attach(session, [datum], now=1050.0)


def test_records_expire_a_day_after_their_last_use_and_stay_bounded() -> None:
    records = _records(now=1000.0)
    records.attach("s1", [_rl_datum([0, 0, 1, 1, 1])], now=1090.0)  # restarts a's clock
    records.attach("s1", [_rl_datum([0, 0, 1, 1, 1])], now=1180.0)  # 90 s after its last use
    assert "b" not in records.records  # b (unused since 1000) expired on the way
    with pytest.raises(BadRequest, match="expired"):
        records.attach("s1", [_rl_datum([0, 0, 1, 1, 1])], now=1300.0)

    records = _records()
    assert records.tokens == 3 + 3 + 3 + 1
    for n in range(5):  # 7 tokens a request: the least recently used records go first
        records.add("s1", [f"x{n}"], [1, 2, 3, 4], [SampledSequence([5, 6, 7], [0, 0, 0], "stop")])
    assert records.tokens <= 40 and "a" not in records.records and "x4" in records.records
    records.drop_session("s1")
    assert len(records) == 0 and records.tokens == 0


def _span(kind: int, sequence_id: str, offset: int, length: int) -> bytes:
    run = bytes_field(1, sequence_id) + varint_field(2, offset) + varint_field(3, length)
    return bytes_field(kind, run)


def test_the_wire_carries_provenance_runs() -> None:
    encoded = bytes_field(1, torch.tensor([7, 8], dtype=torch.int32).numpy().tobytes())
    tokens = bytes_field(1, bytes_field(1, encoded))  # a Chunk holding an EncodedTextChunk
    target = bytes_field(1, torch.tensor([8, 9]).numpy().tobytes()) + varint_field(3, 2)
    inputs = bytes_field(2, bytes_field(1, "target_tokens") + bytes_field(2, target))

    def body(input_runs: list[bytes], target_runs: list[bytes]) -> bytes:
        datum = tokens + inputs
        datum += b"".join(bytes_field(3, r) for r in input_runs)
        datum += b"".join(bytes_field(4, r) for r in target_runs)
        return bytes_field(1, "m") + bytes_field(3, datum) + bytes_field(4, "stable_reinforce")

    request = parse_forward_backward(
        body([_span(1, "a", 0, 1), _span(2, "a", 0, 1)], [_span(2, "a", 0, 2)]), Limits()
    )
    datum = request.data[0]
    assert datum.input_spans == [Span("prompt", "a", 0, 1), Span("sampled", "a", 0, 1)]
    assert datum.target_spans == [Span("sampled", "a", 0, 2)]
    assert parse_forward_backward(body([], []), Limits()).data[0].target_spans is None
    with pytest.raises(BadRequest, match="do not add up"):
        parse_forward_backward(body([_span(1, "a", 0, 1)], [_span(2, "a", 0, 2)]), Limits())
    with pytest.raises(BadRequest, match="neither prompt_tokens nor sampled_tokens"):
        parse_forward_backward(body([bytes_field(5, b"")], [_span(2, "a", 0, 2)]), Limits())


# ---- through the unmodified SDK -------------------------------------------------------------

tinker = pytest.importorskip("tinker", reason="the tinker SDK is the extra creditrl[tinker]")
types = tinker.types


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    from creditrl.tinker.server import TinkerServer
    from creditrl.tinker.service import Settings

    srv = TinkerServer(Settings(out_dir=tmp_path_factory.mktemp("tinker"), max_models=2))
    srv.start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_BASE_URL", server.base_url)
        mp.setenv("TINKER_API_KEY", "tml-local")
        service_client = tinker.ServiceClient()
        yield service_client
        service_client.close("success")


@pytest.fixture(scope="module")
def trainer(client):
    return client.create_lora_training_client(base_model=str(tiny_model_dir()), rank=4).result()


def _reference(server, model_id: str, tokens: list[int]) -> torch.Tensor:
    """log π(x_t | x_<t), t >= 1, from the served module's plain logits."""
    with torch.no_grad():
        logits = server.service.policies[model_id].module(input_ids=torch.tensor([tokens])).logits
    return (
        logits[0, :-1].float().log_softmax(-1).gather(-1, torch.tensor(tokens[1:])[:, None])[:, 0]
    )


def test_stable_reinforce_through_the_sdk(server, trainer) -> None:
    prompt = [1, 30, 31, 32]
    sampler = trainer.save_weights_and_get_sampling_client(record_stability_info=True).result()
    params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=11)
    response = sampler.sample(types.ModelInput.from_ints(prompt), 2, params).result()
    datums, expected = [], 0.0
    for seq, advantage in zip(response.sequences, [1.0, -1.0], strict=True):
        sampled = list(seq.tokens)
        full = prompt + sampled
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(full[:-1]),
            loss_fn_inputs={
                "target_tokens": full[1:],
                "logprobs": [0.0] * (len(prompt) - 1) + list(seq.logprobs),
                "advantages": [0.0] * (len(prompt) - 1) + [advantage] * len(sampled),
            },
        ).with_provenance(  # as tinker_cookbook.recipes.rl_loop lays it out
            model_input=[
                types.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=len(prompt)),
                types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(sampled) - 1),
            ],
            loss_fn_inputs=[
                types.PromptProvenanceSpan(
                    sequence_id=seq.sequence_id, offset=1, length=len(prompt) - 1
                ),
                types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(sampled)),
            ],
        )
        datums.append(datum)
        # on policy the ratio is 1 (under the truncation): l = -A sum log π of the sampled tokens
        lp = _reference(server, trainer.model_id, full)[len(prompt) - 1 :]
        assert torch.allclose(lp, torch.tensor(seq.logprobs), atol=1e-4)
        expected += -advantage * float(lp.sum())
    result = trainer.forward(datums, "stable_reinforce").result()
    assert result.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    assert result.metrics["pg_clipfrac:mean"] == 0.0
    fb = trainer.forward_backward(datums, "stable_reinforce").result()
    assert fb.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()

    bare = types.Datum(model_input=datums[0].model_input, loss_fn_inputs=datums[0].loss_fn_inputs)
    with pytest.raises(tinker.RequestFailedError, match="has no provenance"):
        trainer.forward([bare], "stable_reinforce").result()
    plain = trainer.save_weights_and_get_sampling_client().result()
    other = plain.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0]
    named = types.Datum(
        model_input=types.ModelInput.from_ints(prompt[:-1]),
        loss_fn_inputs={"target_tokens": prompt[1:], "advantages": [0.0] * 3},
    ).with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=other.sequence_id, length=3)],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=other.sequence_id, offset=1, length=3)
        ],
    )
    with pytest.raises(tinker.RequestFailedError, match="not sampled with record_stability_info"):
        trainer.forward([named], "stable_reinforce").result()


def test_gspo_and_dro_through_the_sdk(server, trainer) -> None:
    tokens = [1, 30, 31, 32, 33, 34]
    lp = _reference(server, trainer.model_id, tokens)
    q = (lp - 0.05).tolist()
    advantages = [0.0, 0.0, 1.0, 1.0, -0.5]
    ratio_mask = [0.0, 0.0, 1.0, 1.0, 1.0]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tokens[1:],
            "logprobs": q,
            "advantages": advantages,
            "sequence_ratio_mask": ratio_mask,
        },
    )
    s = math.exp(0.05)  # every masked log-ratio is 0.05
    result = trainer.forward([datum], "gspo").result()
    assert result.metrics["loss:sum"] == pytest.approx(-s * 1.5, rel=1e-4)
    dro = trainer.forward([datum], "dro", {"beta": 0.2}).result()
    expected = -float((lp * torch.tensor(advantages)).sum()) + 0.1 * 5 * 0.05**2
    assert dro.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)


def test_forward_backward_custom_is_served(server, client, trainer) -> None:
    tokens = [1, 40, 41, 42, 43]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:]},
    )

    def squared(data, logprobs):
        loss = sum((lp**2).sum() for lp in logprobs)
        return loss, {"squared": float(loss)}

    lp = _reference(server, trainer.model_id, tokens)
    result = trainer.forward_backward_custom([datum], squared).result()
    assert result.metrics["loss:sum"] == pytest.approx(float((lp**2).sum()), rel=1e-4)
    # the server ran cross_entropy with weights -dC/dlp = -2 lp: sum of 2 lp^2
    assert result.metrics["surrogate_loss:sum"] == pytest.approx(float(2 * (lp**2).sum()), rel=1e-4)
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()

    # a loss made with create_custom_loss runs client-side too (custom_loss_server_side: false)
    def cubed(logprobs):
        return (logprobs**3).sum(), {"custom/cubed:sum": (logprobs**3).sum()}

    handle = client.create_custom_loss(cubed, {"logprobs": 1}).result()
    assert handle.loss_id is None
    lp = _reference(server, trainer.model_id, tokens)
    result = trainer.forward_backward_custom([datum], handle).result()
    assert result.metrics["loss:sum"] == pytest.approx(float((lp**3).sum()), rel=1e-4)
    assert result.metrics["surrogate_loss:sum"] == pytest.approx(float(3 * (lp**3).sum()), rel=1e-4)
