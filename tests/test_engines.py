"""Rollout engines behind one interface and a registry: a user-registered engine trains the
synchronous trainer, vLLM is refused in one line where it cannot run, no code outside the
engines branches on an engine's name, the rollout-only role of the hybrid worker, and an HF
engine subclass in the agent loop."""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from helpers import tiny_engine_config

import creditrl
import creditrl.workers.hybrid as hybrid
from creditrl import cli
from creditrl.batch import Batch
from creditrl.config.schema import RolloutConfig
from creditrl.errors import ConfigError, UserCodeError
from creditrl.models.tiny import tiny_model_dir
from creditrl.rollout import (
    ROLLOUT_ENGINES,
    EngineArgs,
    HFRolloutEngine,
    RolloutEngine,
    build_rollout_engine,
    engine_traits,
    register_rollout_engine,
    rollout_log_probs_are_actors,
)
from creditrl.rollout.continuation import EngineTurnGenerator, TurnRequest
from creditrl.rollout.vllm_engine import assemble_rollout, vllm_unavailable_reason
from creditrl.trainers.rl_trainer import RLTrainer
from creditrl.workers.hybrid import HybridWorker

LOG_PROB = -0.5


@register_rollout_engine("test_fixed_ids")
class FixedIdsEngine(RolloutEngine):
    """Answers each prompt row with ids drawn from its generator (then EOS), each with log-prob
    ``LOG_PROB``; it holds its own weights (records what is pushed) and records wake/sleep."""

    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        self.generator = torch.Generator().manual_seed(args.seed)
        self.events: list[object] = []
        self.pushed: list[dict[str, torch.Tensor]] = []
        self.answers: list[list[int]] = []

    def generate(
        self,
        prompts: Batch,
        *,
        greedy: bool = False,
        temperature: float | None = None,
        seed: int | None = None,
    ) -> Batch:
        self.events.append("generate")
        if seed is not None:
            self.generator.manual_seed(seed)
        eos = self.args.tokenizer.eos_token_id
        self.answers = []
        for _ in range(len(prompts)):
            length = int(
                torch.randint(1, self.args.cfg.max_response_length, (1,), generator=self.generator)
            )
            body = torch.randint(100, 1000, (length - 1,), generator=self.generator).tolist()
            self.answers.append([*body, eos])
        return assemble_rollout(
            prompts,
            [(ids, [LOG_PROB] * len(ids)) for ids in self.answers],
            pad_token_id=self.args.tokenizer.pad_token_id,
            eos_token_ids=[eos],
            max_response_length=self.args.cfg.max_response_length,
        )

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        self.events.append("update_weights")
        self.pushed.append({k: v.clone() for k, v in named_tensors})
        return len(self.pushed[-1])

    def wake_up(self, tags=None) -> None:
        self.events.append(("wake_up", None if tags is None else tuple(tags)))

    def sleep(self) -> None:
        self.events.append("sleep")


def test_a_registered_engine_trains_one_step(tmp_path: Path) -> None:
    """``rollout.engine=<registered name>`` passes validation and runs the trainer's step with
    that engine: its ids and log-probs reach the batch; as it declares inexact log-probs the
    trainer recomputes ``old_log_probs``; as it holds its own weights they are pushed (woken
    for "weights" only) at start and after the update, and it is woken for the rollout and put
    to sleep after it."""
    assert "test_fixed_ids" in ROLLOUT_ENGINES.names()
    assert not engine_traits("test_fixed_ids").exact_log_probs
    cfg = tiny_engine_config(
        tmp_path / "run",
        "rollout.engine=test_fixed_ids",
        "actor.use_rollout_log_probs=true",
        "actor.entropy_coeff=0.01",  # a gradient even when every advantage is 0
    )
    trainer = RLTrainer(cfg)
    assert not trainer.reuse_rollout_log_probs
    worker = trainer.workers.worker
    engine = worker.engine
    assert isinstance(engine, FixedIdsEngine) and engine.args.model is worker.actor.model
    initial = {k: v.clone() for k, v in worker.actor.model.state_dict().items()}
    trainer.fit()

    batch = trainer.last_batch
    mask = batch["response_mask"].bool()
    assert [batch["responses"][i][mask[i]].tolist() for i in range(len(batch))] == engine.answers
    assert (batch["rollout_log_probs"][mask] == LOG_PROB).all()
    assert not torch.allclose(batch["old_log_probs"][mask], batch["rollout_log_probs"][mask])
    weights = ("wake_up", ("weights",))
    assert engine.events == [
        weights, "update_weights",
        ("wake_up", None), "generate", "sleep",
        weights, "update_weights",
    ]  # fmt: skip
    first, last = engine.pushed
    assert set(first) == set(initial)
    assert all(torch.equal(first[k], initial[k]) for k in initial)
    final = worker.actor.model.state_dict()
    assert all(torch.equal(last[k], final[k].cpu()) for k in final)
    assert any(not torch.equal(last[k], initial[k]) for k in initial)


@pytest.mark.skipif(vllm_unavailable_reason() is None, reason="vLLM can run here")
def test_vllm_where_it_cannot_run_is_one_line_before_any_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``rollout.engine=vllm`` without vLLM (or a GPU): the CLI exits 2 with one line naming
    vllm, why, and rollout.engine=hf, and no model is loaded first."""

    def no_model(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was loaded before the engine was checked")

    monkeypatch.setattr(hybrid, "load_causal_lm", no_model)
    overrides = [
        f"model.path={tiny_model_dir()}",
        "data.train_size=4",
        "data.val_size=2",
        "data.train_batch_size=2",
        "actor.ppo_mini_batch_size=1",
        "rollout.engine=vllm",
        "trainer.logger=[jsonl]",
        f"trainer.output_dir={tmp_path / 'run'}",
    ]
    assert cli.main(["train", *overrides]) == 2
    out = capsys.readouterr()
    text = " ".join((out.out + out.err).split())
    assert f"rollout.engine=vllm: {vllm_unavailable_reason()}" in text
    assert "On CPU use rollout.engine=hf." in text
    with pytest.raises(ConfigError, match=r"^rollout\.engine=vllm: .*rollout\.engine=hf\.$"):
        HybridWorker(tiny_engine_config(tmp_path / "direct", "rollout.engine=vllm"))


ENGINE_NAME_TESTS = (
    re.compile(r"""\.engine\s*(?:==|!=)\s*["']"""),
    re.compile(r"""["']\s*(?:==|!=)\s*[\w.]*\.engine\b"""),
    re.compile(r"""\.engine\s+(?:not\s+)?in\s*[(\[{]"""),
    re.compile(r"isinstance\([^)]*(?:HF|VLLM)RolloutEngine"),
    re.compile(r"uses_vllm"),
)


def test_no_engine_name_branches_outside_the_engines() -> None:
    """Outside creditrl/rollout/ and creditrl/config/, no module compares ``rollout.engine`` to
    a name, tests an engine's class, or keeps a ``uses_vllm`` flag: code reads the engine's
    declared traits."""
    root = Path(creditrl.__file__).parent
    offenders = []
    for path in sorted(root.rglob("*.py")):
        if path.relative_to(root).parts[0] in ("rollout", "config"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if any(pattern.search(line) for pattern in ENGINE_NAME_TESTS):
                offenders.append(f"{path.relative_to(root.parent)}:{number}: {line.strip()}")
    assert offenders == []


def test_log_prob_reuse_follows_the_engines_declaration(tmp_path: Path) -> None:
    """``rollout_log_probs_are_actors``: the engine's ``exact_log_probs`` (hf yes, vllm and the
    test engine no) and no top-k/top-p unless they are replayed; validation lists the registered
    engines."""
    cfg = tiny_engine_config(tmp_path)
    assert rollout_log_probs_are_actors(cfg)
    assert rollout_log_probs_are_actors(tiny_engine_config(tmp_path, "rollout.top_k=5"))
    for override in ("rollout.engine=test_fixed_ids", "rollout.engine=vllm"):
        assert not rollout_log_probs_are_actors(tiny_engine_config(tmp_path, override)), override
    unreplayed = tiny_engine_config(tmp_path, "rollout.top_k=5", "rollout.sampling_replay=false")
    assert not rollout_log_probs_are_actors(unreplayed)
    with pytest.raises(ConfigError, match=r"^rollout\.engine='sglang' is not one of hf, ") as e:
        tiny_engine_config(tmp_path, "rollout.engine=sglang")
    assert str(e.value).endswith(", ".join(ROLLOUT_ENGINES.names()))


def prompts_of(worker: HybridWorker) -> Batch:
    """Two left-padded chat prompts, each twice."""
    tok = worker.tokenizer
    rows = [tok.encode(text) for text in ("What is 3 + 4?", "Name a colour, then stop.")]
    width = max(map(len, rows))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return Batch.from_dict({"input_ids": ids, "attention_mask": mask}).repeat(2, interleave=True)


def test_the_rollout_role_samples_like_the_full_worker(tmp_path: Path) -> None:
    """``HybridWorker(roles=("rollout",), with_ref=True)``: a frozen policy (no optimizer, no
    gradients, eval mode) that samples the full worker's tokens for the same seed, the same
    reference log-probs, and, after ``load_policy_weights``, samples from the new weights."""
    cfg = tiny_engine_config(tmp_path, "actor.use_kl_loss=true", "rollout.max_response_length=12")
    full = HybridWorker(cfg)
    rollout = HybridWorker(cfg, roles=("rollout",), with_ref=True)
    assert rollout.actor is None and rollout.critic is None and rollout.trainables() == {}
    policy = rollout.policy_model
    assert not policy.training and not any(p.requires_grad for p in policy.parameters())
    assert set(rollout.generators()) == {"rollout"}

    prompts = prompts_of(full)
    expected = full.generate(prompts, seed=11)
    got = rollout.generate(prompts, seed=11)
    assert torch.equal(got["responses"], expected["responses"])
    torch.testing.assert_close(got["rollout_log_probs"], expected["rollout_log_probs"])
    ref = rollout.compute_ref_log_prob(got, 1.0)["ref_log_prob"]
    torch.testing.assert_close(ref, full.compute_ref_log_prob(expected, 1.0)["ref_log_prob"])

    moved = {k: 1.5 * v for k, v in policy.state_dict().items()}  # tied tensors stay tied
    rollout.load_policy_weights(moved)
    assert all(torch.equal(policy.state_dict()[k], v) for k, v in moved.items())
    after = rollout.generate(prompts, seed=11)
    assert not torch.equal(after["responses"], expected["responses"])
    with pytest.raises(RuntimeError, match="no reference model"):
        HybridWorker(cfg, roles=("rollout",)).compute_ref_log_prob(got, 1.0)


def test_the_rollout_role_pushes_loaded_weights_to_an_engine_with_its_own(
    tmp_path: Path,
) -> None:
    """With an engine that holds its own weights, the rollout role pushes the policy's at start
    and again on ``load_policy_weights``; roles are checked."""
    cfg = tiny_engine_config(tmp_path, "rollout.engine=test_fixed_ids")
    worker = HybridWorker(cfg, roles=("rollout",))
    engine = worker.engine
    assert engine.events == [("wake_up", ("weights",)), "update_weights"]
    moved = {k: v + 1 for k, v in worker.policy_model.state_dict().items()}
    worker.load_policy_weights(moved)
    assert all(torch.equal(engine.pushed[-1][k], v) for k, v in moved.items())
    with pytest.raises(ValueError, match="exclude each other"):
        HybridWorker(cfg, roles=("actor", "rollout"))
    with pytest.raises(ValueError, match=r"unknown HybridWorker roles \['sampler'\]"):
        HybridWorker(cfg, roles=("sampler",))


@register_rollout_engine("test_hf_subclass")
class CountingHFEngine(HFRolloutEngine):
    """The HF engine, counting its generate() calls (the docs' starting point for an engine)."""

    calls = 0

    def generate(self, prompts: Batch, **kwargs: object) -> Batch:
        type(self).calls += 1
        return super().generate(prompts, **kwargs)


def test_an_hf_subclass_inherits_traits_and_serves_the_agent_loop(model, tokenizer) -> None:
    """A registered subclass of the HF engine inherits its declarations and ``from_args``, and
    the agent loop's per-turn engine is the same class (its override runs every turn), sharing
    the model and generator, capped at ``max_tokens_per_turn``."""
    traits = engine_traits("test_hf_subclass")
    assert traits.samples_with_actor_module and traits.exact_log_probs
    cfg = RolloutConfig(engine="test_hf_subclass", max_response_length=16, temperature=1.0)
    engine = build_rollout_engine(EngineArgs(cfg, tokenizer, "unused", model, seed=3))
    assert type(engine) is CountingHFEngine and engine.model is model
    turns = EngineTurnGenerator(engine, tokenizer, max_tokens_per_turn=5)
    assert type(turns.turn_engine) is CountingHFEngine
    assert turns.turn_engine.cfg.max_response_length == 5 and engine.cfg.max_response_length == 16
    assert turns.turn_engine.model is model and turns.turn_engine.generator is engine.generator
    before = CountingHFEngine.calls
    (out,) = turns.generate_turns([TurnRequest([1, 520, 9, 33], 5, seed=7)])
    assert CountingHFEngine.calls == before + 1 and 1 <= len(out.ids) <= 5


@register_rollout_engine("test_bare_builder", exact_log_probs=True)
def bare_builder(args: EngineArgs) -> object:
    """A builder whose engine has only ``generate``."""
    return type("Bare", (), {"generate": lambda self, prompts, **kw: prompts})()


def test_builders_declare_traits_by_keyword_and_are_checked(tokenizer) -> None:
    """A builder function registers with its traits as keywords; an engine missing part of the
    interface is a one-line UserCodeError naming what it lacks; unknown traits are refused."""
    traits = engine_traits("test_bare_builder")
    assert traits.exact_log_probs and not traits.samples_with_actor_module
    cfg = RolloutConfig(engine="test_bare_builder")
    with pytest.raises(
        UserCodeError, match=r"Bare\) lacks \['update_weights', 'wake_up', 'sleep', 'generator'\]"
    ):
        build_rollout_engine(EngineArgs(cfg, tokenizer, "unused"))
    with pytest.raises(TypeError, match=r"unknown traits \['exact'\]"):
        register_rollout_engine("test_typo", exact=True)
