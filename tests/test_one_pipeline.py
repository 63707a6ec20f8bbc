"""One pipeline: the synchronous trainer, the async sampler and the async learner run the same
stage functions (creditrl.pipeline.step), so they agree number for number and the async pair
gains what the trainer has (agents, registered engines, critics, validation)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from helpers import model_group, tiny_learner_config

from creditrl.asynchronous.learner import Learner, concat_groups
from creditrl.asynchronous.settings import check_async_config
from creditrl.cli import main
from creditrl.errors import ConfigError
from creditrl.models import load_causal_lm
from creditrl.models.tiny import tiny_model_dir
from creditrl.trainers.rl_trainer import RLTrainer

VOLATILE = ("timing_s/", "perf/", "timing_per_token_ms/")


def _groups() -> object:
    model = load_causal_lm(tiny_model_dir())
    groups = [
        model_group(model, "s0", 0, 0, (1.0, 0.0)),
        model_group(model, "s0", 1, 0, (0.0, 1.0)),
    ]
    return concat_groups(groups, pad_token_id=2)


@pytest.mark.parametrize("preset", ["grpo", "ppo"])
def test_learner_training_half_equals_the_synchronous_trainer(tmp_path: Path, preset: str) -> None:
    """Given the same groups, the learner's update and the synchronous trainer's training half
    give equal metrics and equal weights (1e-6): both are StepPipeline.training_half over the
    same hybrid worker. With preset=ppo the learner also builds and trains a critic (the
    estimator requires values), which the old learner could not."""
    extra = ["asynchronous.old_log_probs=sampler", f"preset={preset}",
             "critic.ppo_mini_batch_size=2", "algorithm.lam=0.95"]  # fmt: skip
    learner = Learner(tiny_learner_config(tmp_path / "learner", *extra))
    trainer = RLTrainer(tiny_learner_config(tmp_path / "sync", *extra))
    batch = _groups()
    batch["staleness"] = torch.zeros(len(batch), dtype=torch.long)
    learner.step = 1
    learned, a = learner.update(copy.deepcopy(batch), {})
    synced, b = trainer.training.run(copy.deepcopy(batch), 1, {}, keep_rollout=True)
    trainer.close()
    keys = {k for k in a if not k.startswith(VOLATILE)}
    assert keys == {k for k in b if not k.startswith(VOLATILE)}
    for key in keys:
        assert a[key] == pytest.approx(b[key], abs=1e-6), key
    if preset == "ppo":
        assert "critic/vf_loss" in a and "values" in learned
    mine = learner.actor.model.state_dict()
    theirs = trainer.workers.worker.actor.model.state_dict()
    for name, value in mine.items():
        torch.testing.assert_close(value, theirs[name], atol=1e-6, rtol=0, msg=name)
    torch.testing.assert_close(learned["advantages"], synced["advantages"], atol=1e-6, rtol=0)


def test_async_with_an_engine_this_machine_lacks_names_it(tmp_path: Path, capsys) -> None:
    """rollout.engine=vllm without vLLM: `creditrl async` stops before starting any process,
    naming vllm in one line (the sampler used to hard-code the HF engine and ignore the key)."""
    with pytest.raises(ConfigError, match="vllm"):
        check_async_config(tiny_learner_config(tmp_path, "rollout.engine=vllm"))
    code = main(["async", f"model.path={tiny_model_dir()}", "rollout.engine=vllm",
                 f"trainer.output_dir={tmp_path / 'run'}"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 2 and "vllm" in out and "Traceback" not in out


def test_async_calculator_agent_uses_tools_and_validates(tmp_path: Path) -> None:
    """`creditrl async preset=calculator_agent`: the sampler runs the agent loop (tools/*
    metrics in its log, turn_ids and tool calls reach the learner) and the learner validates
    (val/score before and after)."""
    out = tmp_path / "run"
    code = main([
        "async", f"model.path={tiny_model_dir()}", "preset=calculator_agent",
        "data.train_size=16", "data.val_size=2", "data.train_batch_size=2", "rollout.n=2",
        "actor.ppo_mini_batch_size=2", "rollout.max_response_length=48",
        "agent.max_tokens_per_turn=16", "agent.max_turns=2", "trainer.total_steps=1",
        "trainer.test_freq=1", "trainer.logger=[jsonl]", "reward.num_workers=1",
        f"trainer.output_dir={out}", "asynchronous.port=0", "asynchronous.dist_port=0",
        "trainer.rollout_dump_rows=1",
    ])  # fmt: skip
    assert code == 0
    steps = {
        r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    }
    assert "val/score" in steps[0] and "val/score" in steps[1]
    assert "tools/calls" in steps[1] and "num_turns/mean" in steps[1]  # the learner's, too
    sampler_log = next((out / "samplers").rglob("metrics.jsonl")).read_text().splitlines()
    assert any("tools/calls" in json.loads(line) for line in sampler_log)
    dump = json.loads((out / "rollouts" / "step_000001.jsonl").read_text().splitlines()[0])
    assert "turn_ids" in dump["per_token"]
