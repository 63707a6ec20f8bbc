"""The engine contract, declared: an engine that declares nothing gets RolloutEngine's
conservative defaults, read by the agent loop's adapter instead of probing; an engine that
reads the learner's published folders itself gets them (weights_via="folder")."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from helpers import tiny_learner_config

from creditrl.asynchronous.sampler import Sampler
from creditrl.asynchronous.settings import weight_root
from creditrl.batch import Batch
from creditrl.config.schema import RolloutConfig
from creditrl.errors import UserCodeError
from creditrl.models import load_tokenizer
from creditrl.models.tiny import tiny_model_dir
from creditrl.rollout import (
    EngineArgs,
    HFRolloutEngine,
    RolloutEngine,
    build_rollout_engine,
    engine_traits,
    register_rollout_engine,
)
from creditrl.rollout.continuation import EngineTurnGenerator, TurnRequest
from creditrl.weights import WeightPublisher, load_tensors

ANSWER = [17, 18, 19, 20, 21, 22]


@register_rollout_engine("test_declares_nothing")
class DeclaresNothing(RolloutEngine):
    """Only what every engine must have: generate, update_weights and a generator."""

    def __init__(self, args: EngineArgs) -> None:
        self.pad = args.tokenizer.pad_token_id
        self.generator = torch.Generator().manual_seed(0)

    def generate(self, prompts: Batch, **kwargs: object) -> Batch:
        n = len(prompts)
        responses = torch.tensor([ANSWER] * n)
        return Batch(
            {
                "responses": responses,
                "response_mask": torch.ones_like(responses),
                "rollout_log_probs": torch.full(responses.shape, -0.5),
            }
        )

    def update_weights(self, named_tensors: object) -> int:
        return 0


@register_rollout_engine("test_reads_folders", weights_via="folder")
class ReadsFolders(HFRolloutEngine):
    """The HF engine holding its own weights, loaded from the published folder by itself."""

    samples_with_actor_module = False

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)
        self.folders: list[Path] = []

    def load_weights_folder(self, folder: Path) -> None:
        self.folders.append(folder)
        self.model.load_state_dict(load_tensors(folder / "weights.safetensors"))


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(tiny_model_dir())


def test_an_engine_that_declares_nothing_gets_the_conservative_defaults(tokenizer) -> None:
    """No cap view (turns are cut after sampling), the tokenizer's EOS, no kept turn KV, no
    stats, no model or context length, weights pushed as tensors, not exact, not sharing the
    actor's module; the agent loop's adapter runs on it."""
    cfg = RolloutConfig(engine="test_declares_nothing", max_response_length=8)
    engine = build_rollout_engine(EngineArgs(cfg, tokenizer, "unused"))
    traits = engine_traits("test_declares_nothing")
    assert (traits.weights_via, traits.exact_log_probs, traits.samples_with_actor_module) == (
        "tensors", False, False,
    )  # fmt: skip
    assert engine.capped(3) is engine and not engine.keeps_turn_kv()
    assert engine.eos_token_ids is None and dict(engine.last_stats) == {}
    assert engine.model is None and engine.context_length() is None
    turns = EngineTurnGenerator(engine, tokenizer, max_tokens_per_turn=3)
    assert turns.turn_engine is engine and turns.turn_cache is None
    assert turns.eos_token_ids == [tokenizer.eos_token_id]
    (out,) = turns.generate_turns([TurnRequest([1, 520, 9], 3)])
    assert out.ids == ANSWER[:3] and out.log_probs == [-0.5] * 3
    assert turns.run_stats["prefill_tokens"] is None  # not reported
    with pytest.raises(NotImplementedError, match="weights_via='folder'"):
        engine.load_weights_folder(Path("unused"))


def test_an_engine_must_subclass_the_interface(tokenizer) -> None:
    """What a builder returns is refused in one line unless it is a RolloutEngine."""

    @register_rollout_engine("test_not_a_subclass")
    def build(args: EngineArgs) -> object:
        members = {"generate": None, "update_weights": None, "wake_up": None, "sleep": None}
        return type("Lookalike", (), {**members, "generator": torch.Generator()})()

    cfg = RolloutConfig(engine="test_not_a_subclass")
    with pytest.raises(UserCodeError, match=r"Lookalike\) is not a creditrl.rollout.RolloutEngine"):
        build_rollout_engine(EngineArgs(cfg, tokenizer, "unused"))
    with pytest.raises(TypeError, match="weights_via='disk'"):
        register_rollout_engine("test_bad_transfer", weights_via="disk")(DeclaresNothing)


def test_weights_reach_a_folder_engine_from_the_published_folder(tmp_path: Path) -> None:
    """weights_via="folder": the sampler hands the engine the newest published folder (the
    version it then samples with); the engine's weights are the published ones."""
    cfg = tiny_learner_config(tmp_path, "rollout.engine=test_reads_folders", "data.train_size=8")
    sampler = Sampler(cfg, 0)
    try:
        engine = sampler.worker.engine
        assert isinstance(engine, ReadsFolders) and sampler.version == 0
        trained = copy.deepcopy(engine.model)
        with torch.no_grad():
            for p in trained.parameters():
                p.add_(0.01)
        publisher = WeightPublisher(weight_root(cfg), 2, cfg.asynchronous.lora_sync)
        publisher.publish(trained, 1)
        assert sampler.weights.refresh() and sampler.version == 1
        assert engine.folders == [weight_root(cfg) / "v00000001"]
        for name, value in trained.state_dict().items():
            assert torch.equal(engine.model.state_dict()[name], value), name
        assert not sampler.weights.refresh() and sampler.version == 1  # nothing newer
        assert len(engine.folders) == 1
    finally:
        sampler.close()


class _CapsToNothing(DeclaresNothing):
    def capped(self, max_new_tokens: int) -> RolloutEngine:
        return None  # type: ignore[return-value]


class _TextEos(DeclaresNothing):
    eos_token_ids = ("</s>",)


class _NegativeContext(DeclaresNothing):
    def context_length(self) -> int | None:
        return -5


class _RaisingStats(DeclaresNothing):
    def keeps_turn_kv(self) -> bool:
        raise RuntimeError("not ready")


@pytest.mark.parametrize(
    ("engine", "says"),
    [
        (_CapsToNothing, "capped(8) returned a NoneType, not a RolloutEngine"),
        (_TextEos, "eos_token_ids must be None or token ids (ints >= 0), got ('</s>',)"),
        (_NegativeContext, "context_length() must be None or a positive int, got -5"),
        (_RaisingStats, "keeps_turn_kv() raised RuntimeError: not ready"),
    ],
)
def test_an_engines_declarations_are_checked_once_at_build(
    tokenizer, engine: type, says: str
) -> None:
    """A user engine's declarations were read, not checked: capped(n) returning None was an
    AttributeError traceback at the first turn, text EOS ids a ValueError traceback, a negative
    context length refused every episode without a word about the engine. Each is checked when
    the engine is built, in one line naming it."""
    name = f"test_declares_{engine.__name__.lower()}"
    register_rollout_engine(name)(engine)
    cfg = RolloutConfig(engine=name, max_response_length=8)
    with pytest.raises(UserCodeError) as raised:
        build_rollout_engine(EngineArgs(cfg, tokenizer, "unused"))
    message = str(raised.value)
    assert message.startswith(f"rollout.engine={name}: ") and says in message, message
    assert "\n" not in message
