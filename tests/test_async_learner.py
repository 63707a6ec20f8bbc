"""The async learner in one process (a stand-in socket): bounded staleness, whole-group batches,
GSPO and GRPO loss values against hand computation, and the LoRA weight round trip."""

import copy
import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from helpers import model_group, tiny_learner_config

from creditrl.asynchronous.learner import Learner
from creditrl.asynchronous.messages import decode, episodes_message
from creditrl.asynchronous.settings import check_async_config
from creditrl.asynchronous.staleness import BufferedGroup, GroupBuffer, concat_groups
from creditrl.batch import Batch
from creditrl.cli import main
from creditrl.models import apply_lora, load_causal_lm
from creditrl.models.tiny import tiny_model_dir
from creditrl.run_lock import RunLock
from creditrl.weights import WeightPublisher, WeightSubscriber, merged_state_dict
from creditrl.workers import policy_forward


class StandInSocket:
    """Records what the learner sends; delivers queued (sampler_id, message) pairs."""

    address = "stand-in"

    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []
        self.inbox: list[tuple[str, object]] = []

    def send(self, sampler_id: str, frames: list[bytes]) -> bool:
        self.sent.append((sampler_id, decode(frames)))
        return True

    def recv(self, timeout_s: float):
        return self.inbox.pop(0) if self.inbox else None

    def acks(self) -> list[tuple[str, int, str]]:
        return [
            (s, a["seq"], a["status"])
            for s, m in self.sent
            if m.kind == "ack"
            for a in m.header["acks"]
        ]


def deliver(learner: Learner, socket: StandInSocket, group: Batch) -> None:
    sampler_id, seq = group["sampler_id"][0], int(group["episode_id"][0].split(":")[1])
    learner._handle(sampler_id, decode(episodes_message(sampler_id, seq, group)))


# ---- buffer and batches ------------------------------------------------------------------


def test_buffer_drops_beyond_max_staleness_and_takes_oldest_first() -> None:
    buffer = GroupBuffer(max_staleness=2)
    for seq, version in enumerate([3, 6, 4, 5]):
        buffer.add(BufferedGroup("s0", seq, version, Batch({"x": torch.zeros(2)})))
    with pytest.raises(ValueError, match="already buffered"):
        buffer.add(BufferedGroup("s0", 1, 6, Batch({"x": torch.zeros(2)})))
    stale = buffer.drop_stale(version=6)  # 6 - 3 = 3 > 2; 6 - 4 = 2 is kept
    assert [(g.seq, g.version) for g in stale] == [(0, 3)]
    assert [g.seq for g in buffer.take(2)] == [1, 2] and len(buffer) == 1
    assert buffer.holds("s0", 3) and not buffer.holds("s0", 1)


def test_concat_groups_pads_prompts_left_and_responses_right() -> None:
    model = load_causal_lm(tiny_model_dir())
    a, b = model_group(model, "s0", 0, 0), model_group(model, "s1", 2, 0)
    b = b[[0, 1]]
    b["responses"] = b["responses"][:, :3].clone()  # a group whose longest answer is 3
    for name in ("response_mask", "rollout_log_probs", "token_level_scores"):
        b[name] = b[name][:, :3].clone()
    b["attention_mask"] = b["attention_mask"][:, :-1].clone()
    b["input_ids"] = b["input_ids"][:, :-1].clone()
    b["position_ids"] = b["position_ids"][:, :-1].clone()
    out = concat_groups([a, b], pad_token_id=2)
    assert out["prompts"].shape == (4, 5) and out["responses"].shape == (4, 4)
    assert out["input_ids"].shape == out["attention_mask"].shape == (4, 9)
    assert torch.equal(out["prompts"][:2, 2:], a["prompts"]) and (out["prompts"][:2, :2] == 2).all()
    assert (
        torch.equal(out["responses"][2:, :3], b["responses"])
        and (out["responses"][2:, 3] == 2).all()
    )
    assert torch.equal(out["response_mask"][2:, 3], torch.zeros(2, dtype=torch.long))
    # real tokens keep their ids and positions, so log-probs are those of the original rows
    with torch.no_grad():
        lp = policy_forward(model, out, 1.0)[0] * out["response_mask"]
    torch.testing.assert_close(lp, out["rollout_log_probs"], atol=1e-5, rtol=0)
    assert list(out["episode_id"]) == ["s0:0:0", "s0:0:1", "s1:2:0", "s1:2:1"]


# ---- staleness in the learner ------------------------------------------------------------


def test_learner_drops_stale_groups_dedups_and_corrects_the_rest(tmp_path: Path) -> None:
    cfg = tiny_learner_config(
        tmp_path, "asynchronous.max_staleness=2", "trainer.rollout_dump_rows=4"
    )
    learner = Learner(cfg)
    learner.socket = socket = StandInSocket()
    learner.version = 5
    model = copy.deepcopy(learner.actor.model)
    fresh, too_old, old_ok = (model_group(model, "s0", 0, 5), model_group(model, "s1", 0, 2),
                              model_group(model, "s1", 1, 4))  # fmt: skip
    from_the_future = model_group(model, "s2", 0, 9)  # a version this learner never published
    for group in (fresh, too_old, old_ok, fresh, from_the_future):
        deliver(learner, socket, group)
    # 5 - 2 > 2: dropped and acknowledged at once; version 9 > 5: rejected
    assert socket.acks() == [("s1", 0, "stale"), ("s2", 0, "rejected")]
    assert learner.counters["rejected"] == learner.counters["rejected/version"] == 1
    assert learner.counters["dropped_stale_groups"] == 1
    assert learner.counters["dropped_stale_episodes"] == 2
    assert learner.counters["duplicate_groups"] == 1  # the repeat of a buffered group

    learner.step = 1
    metrics = learner.train_step()
    assert metrics["async/staleness/mean"] == 0.5 and metrics["async/staleness/max"] == 1.0
    assert metrics["async/on_policy_fraction"] == 0.5
    assert socket.acks()[2:] == [("s0", 0, "trained"), ("s1", 1, "trained")]
    batch = learner.last_batch
    assert batch["staleness"].tolist() == [0, 0, 1, 1]
    mask = batch["response_mask"].bool()
    # on-policy rows keep the behaviour log-probs; stale rows were recomputed (here the same
    # weights, so equal up to float noise) and carry importance weights pi_old / pi_behaviour
    assert torch.equal(batch["old_log_probs"][:2], batch["rollout_log_probs"][:2])
    torch.testing.assert_close(
        batch["old_log_probs"][2:], batch["rollout_log_probs"][2:], atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        batch["rollout_is_weights"][mask], torch.ones(int(mask.sum())), atol=1e-4, rtol=0
    )
    learner.publisher.wait()
    assert learner.version == 6 and WeightSubscriber(tmp_path / "weights").latest() == 6
    rows = [
        json.loads(x)
        for x in (tmp_path / "rollouts" / "step_000001.jsonl").read_text().splitlines()
    ]
    assert [r["staleness"] for r in rows] == [0, 0, 1, 1]
    assert [r["episode_id"] for r in rows] == ["s0:0:0", "s0:0:1", "s1:1:0", "s1:1:1"]
    assert "rollout_is_weights" in rows[2]["per_token"]

    deliver(learner, socket, fresh)  # consumed already: acknowledged as a duplicate, not trained
    assert socket.acks()[-1] == ("s0", 0, "duplicate") and len(learner.buffer) == 0


# ---- loss values ------------------------------------------------------------------------


def _hand_losses(new, old, ref, mask, adv, loss: str, eps=(0.2, 0.2), c=3.0):
    """pg loss and k3 KL loss by plain Python arithmetic, aggregated token-mean for GRPO and
    seq-mean-token-mean for GSPO (the presets' modes)."""
    kl_rows, pg_rows = [], []
    for i in range(len(new)):
        valid = [j for j in range(len(new[i])) if mask[i][j]]
        a = adv[i]
        if loss == "gspo":
            s = math.exp(sum(new[i][j] - old[i][j] for j in valid) / len(valid))
            clipped = min(max(s, 1 - eps[0]), 1 + eps[1])
            pg_rows.append([max(-a * s, -a * clipped) for _ in valid])
        else:
            row = []
            for j in valid:
                r = math.exp(new[i][j] - old[i][j])
                value = max(-a * r, -a * min(max(r, 1 - eps[0]), 1 + eps[1]))
                row.append(min(value, -a * c) if a < 0 else value)
            pg_rows.append(row)
        kl_rows.append(
            [math.exp(ref[i][j] - new[i][j]) - (ref[i][j] - new[i][j]) - 1 for j in valid]
        )

    def aggregate(rows: list[list[float]]) -> float:
        if loss == "gspo":
            return sum(sum(r) / len(r) for r in rows) / len(rows)
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)

    return aggregate(pg_rows), aggregate(kl_rows)


@pytest.mark.parametrize("loss", ["ppo", "gspo"])
def test_gspo_and_grpo_loss_values_equal_hand_computation(tmp_path: Path, loss: str) -> None:
    extra = ["actor.use_kl_loss=true", "actor.kl_loss_coef=0.1", "actor.kl_loss_type=low_var_kl"]
    extra += ["asynchronous.old_log_probs=sampler", f"actor.policy_loss={loss}"]
    if loss == "gspo":
        extra += ["preset=gspo", "actor.clip_ratio_low=0.005", "actor.clip_ratio_high=0.01"]
    cfg = tiny_learner_config(tmp_path, *extra)
    learner = Learner(cfg)
    model = copy.deepcopy(learner.actor.model)
    batch = model_group(model, "s0", 0, 0, score=(1.0, 0.0))
    new = batch["rollout_log_probs"].clone()
    mask = batch["response_mask"]
    offsets = torch.tensor([[0.1, 0.0, -0.3, 0.25], [-0.1, 0.3, 0.05, 0.0]])
    batch["rollout_log_probs"] = (new - offsets) * mask  # pi_old: ratios exp(offset) per token
    batch["ref_log_prob"] = (
        new + torch.tensor([[0.0, -0.1, 0.1, 0.2], [0.05, 0.2, -0.4, 0.0]])
    ) * mask
    batch["staleness"] = torch.zeros(2, dtype=torch.long)
    _, metrics = learner.update(batch, {})
    a = 0.5 / (math.sqrt(0.5) + 1e-6)  # GRPO: scores (1, 0), mean 0.5, unbiased std sqrt(0.5)
    torch.testing.assert_close(batch["advantages"][0, :4], torch.full((4,), a))
    torch.testing.assert_close(batch["advantages"][1, :3], torch.full((3,), -a))
    eps = (0.005, 0.01) if loss == "gspo" else (0.2, 0.2)
    pg, kl = _hand_losses(
        new.tolist(), batch["old_log_probs"].tolist(), batch["ref_log_prob"].tolist(),
        mask.tolist(), [a, -a], loss, eps,
    )  # fmt: skip
    assert metrics["actor/pg_loss"] == pytest.approx(pg, abs=2e-6)
    assert metrics["actor/kl_loss"] == pytest.approx(kl, abs=2e-6)
    assert metrics["actor/pg_clipfrac"] > 0 and metrics["actor/kl_loss"] > 0  # clips exercised


# ---- LoRA -------------------------------------------------------------------------------


def test_lora_learner_round_trip(tmp_path: Path) -> None:
    cfg = tiny_learner_config(
        tmp_path, "model.lora_rank=4", "model.lora_alpha=8", "actor.optim.lr=5e-2",
        "actor.use_kl_loss=true", "asynchronous.ref_on=learner",
    )  # fmt: skip
    learner = Learner(cfg)
    learner.socket = socket = StandInSocket()
    plain = load_causal_lm(tiny_model_dir())
    for seq in range(2):
        deliver(learner, socket, model_group(plain, "s0", seq, 0, score=(1.0, 0.0)))
    learner.step = 1
    metrics = learner.train_step()
    assert metrics["actor/kl_loss"] >= 0 and "ref_log_prob" in learner.last_batch
    peft_model = learner.actor.model.eval()
    ids = torch.randint(3, 40000, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
        base = plain(input_ids=ids).logits
    assert (expected - base).abs().max() > 1e-4  # the adapters moved the policy

    learner.publisher.wait()
    sampler_model = load_causal_lm(tiny_model_dir())  # samplers load merged weights ...
    assert WeightSubscriber(tmp_path / "weights").maybe_load(sampler_model, 0) == 1
    with torch.no_grad():
        torch.testing.assert_close(sampler_model(input_ids=ids).logits, expected, atol=1e-5, rtol=0)

    WeightPublisher(tmp_path / "adapters", lora_sync="adapter").publish(peft_model, 1)
    adapter_model = apply_lora(load_causal_lm(tiny_model_dir()), 4, 8)  # ... or the adapters
    assert WeightSubscriber(tmp_path / "adapters").maybe_load(adapter_model, 0) == 1
    with torch.no_grad():
        got = adapter_model.eval()(input_ids=ids).logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)

    merged = copy.deepcopy(peft_model).merge_and_unload().state_dict()
    mine = merged_state_dict(peft_model)
    assert set(mine) == set(merged)
    for key, value in merged.items():
        torch.testing.assert_close(mine[key], value, atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "override,match",
    [
        ("algorithm.adv_estimator=remax", "greedy baseline"),
        ("asynchronous.ref_on=both", "ref_on='both' is not one of sampler, learner"),
        ("asynchronous.max_inflight_groups=1", "wait for acknowledgements forever"),
        ("asynchronous.learners=3", "divide evenly"),
        ("algorithm.filter_groups.enable=true", "DAPO dynamic sampling"),
    ],
)
def test_settings_the_async_pair_cannot_honour_are_named(
    tmp_path: Path, override: str, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        check_async_config(tiny_learner_config(tmp_path, *override.split()))


def test_a_tampered_weight_pointer_is_refused_and_nothing_outside_is_loaded(tmp_path: Path) -> None:
    """``latest`` naming a folder outside the published versions (``../elsewhere``), a version
    that is no number, or a pointer nested deep: one ValueError naming the pointer, and no
    weights are read from anywhere else (before: the sampler loaded whatever folder it named,
    and a deep pointer was a RecursionError)."""
    root = tmp_path / "weights"
    model = load_causal_lm(tiny_model_dir())
    WeightPublisher(root).publish(model, 3)
    assert WeightSubscriber(root).latest() == 3
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(root / "v00000003", elsewhere)
    for text, message in (
        ('{"version": 4, "dir": "../elsewhere"}', "names folder '../elsewhere', not v00000004"),
        ('{"version": "4", "dir": "v00000004"}', "no version number"),
        ('{"version": ' + "[" * 1000 + "]" * 1000 + "}", "nested 1001 deep, above the limit of 4"),
    ):
        (root / "latest").write_text(text)
        with pytest.raises(ValueError, match=message):
            WeightSubscriber(root).maybe_load(model, 0)


class _StandInLearner:
    """Builds nothing and trains nothing (the command's start-up lines are what is tested)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass

    def fit(self) -> None:
        pass


def test_the_async_default_aggregation_is_one_start_up_line(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`creditrl async` and `creditrl learner` train with actor.loss_agg_mode=
    seq-mean-token-mean when nothing the user gave set it (the async default, spec 003), where
    `creditrl train` uses token-mean: each says so in one note line naming both and the key
    (before: nothing said so); a preset, file or override that sets it gets no line."""
    config = tmp_path / "run.yaml"
    config.write_text(f"model:\n  path: {tiny_model_dir()}\ntrainer:\n  output_dir: {tmp_path}\n")
    note = (
        "note: actor.loss_agg_mode=seq-mean-token-mean: the async default (spec 003), which no "
        "preset, file or override set; creditrl train uses actor.loss_agg_mode=token-mean; set "
        "actor.loss_agg_mode to choose"
    )
    monkeypatch.setattr("creditrl.asynchronous.learner.Learner", _StandInLearner)

    def notes(*args: str) -> list[str]:
        capsys.readouterr()
        main(list(args))
        captured = capsys.readouterr()
        text = " ".join((captured.out + captured.err).split())  # rich wraps long lines
        lines = re.split(r" (?=(?:note|warning|error): )", text)
        return [line for line in lines if line.startswith("note: actor")]

    assert notes("learner", str(config)) == [note]
    assert notes("learner", str(config), "actor.loss_agg_mode=seq-mean-token-mean") == []
    assert notes("learner", str(config), "preset=gspo") == []
    with RunLock.acquire(tmp_path):  # creditrl async then stops after its start-up lines
        assert notes("async", str(config)) == [note]
        assert notes("async", str(config), "actor.loss_agg_mode=token-mean") == []
