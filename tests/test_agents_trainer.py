"""A 2-step multi-turn GRPO run through the trainer on the tiny model, with forced turns: tool
calls, observations, structured rewards, drift metrics, the first-mini-batch health check, and
a non-canonical token path that reaches the update unchanged."""

import json
from pathlib import Path

import torch

from creditrl.agents.scripted import ScriptedTurnGenerator
from creditrl.config.loader import load_config
from creditrl.models import load_tokenizer
from creditrl.models.tiny import tiny_model_dir
from creditrl.trainers.rl_trainer import RLTrainer


def scripts(tok) -> list[list[list[int]]]:
    """Samples 0/1 (one prompt) and 2/3 (another): a good call then an answer; the same with a
    non-canonical "<think>"; a malformed call then an answer; an answer at once."""
    eos = tok.eos_token_id
    vocab = tok.get_vocab()

    def enc(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    call = enc(
        '<tool_call>{"name": "calculator", "arguments": {"expression": "3 + 4"}}</tool_call>'
    )
    answer = enc("<answer>7</answer>")
    think = [vocab["<"], vocab["th"], vocab["ink"], vocab[">"], *enc("sum</think>")]
    return [
        [[*call, eos], [*answer, eos]],
        [[*call, eos], [*think, *answer, eos]],
        [[*enc('<tool_call>{"name": calculator}</tool_call>'), eos], [*answer, eos]],
        [[*answer, eos]],
    ]


def test_two_step_multiturn_grpo_on_the_tiny_model(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cfg = load_config(
        overrides=[
            "preset=calculator_agent",
            f"model.path={tiny_model_dir()}",
            "data.system_prompt=Use the calculator.",
            "data.train_size=8",
            "data.val_size=2",
            "data.train_batch_size=2",
            "data.shuffle=false",
            "rollout.n=2",
            "rollout.temperature=1.0",
            "rollout.max_response_length=64",
            "actor.ppo_mini_batch_size=1",
            "actor.ppo_micro_batch_size=2",
            "actor.optim.lr=1e-3",
            "actor.autocast=none",
            "trainer.total_steps=2",
            "trainer.save_freq=0",
            "trainer.test_freq=2",
            "trainer.logger=[jsonl]",
            f"trainer.output_dir={out}",
        ]
    )
    trainer = RLTrainer(cfg)
    rollout = trainer.workers.worker.rollout
    tok = load_tokenizer(tiny_model_dir())
    forced = ScriptedTurnGenerator(
        scripts(tok), [tok.eos_token_id], trainer.workers.worker.actor.model
    )
    rollout.turns = rollout.loop.generator = forced
    trainer.fit()

    batch = trainer.last_batch
    mask, responses = batch["response_mask"], batch["responses"]
    real = batch["attention_mask"][:, -responses.shape[1] :].bool()
    observation = real & ~mask.bool()
    assert observation[:3].any(dim=1).all() and not observation[3].any()
    # the policy's ids reach the update as produced, the non-canonical path included
    think = scripts(tok)[1][1][:4]
    row = responses[1].tolist()
    assert any(row[i : i + 4] == think for i in range(len(row)))
    for i, script in enumerate(scripts(tok)):
        assert responses[i][mask[i].bool()].tolist() == [t for turn in script for t in turn]
    assert batch["num_turns"].tolist() == [2, 2, 2, 1]
    for name in ("advantages", "token_level_scores", "token_level_rewards", "old_log_probs"):
        assert (batch[name][observation] == 0).all(), name
    assert (batch["advantages"][mask.bool()] != 0).any()
    assert (batch["rollout_log_probs"][observation] == 0).all()

    metrics = {
        r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    }
    step = metrics[2]
    assert (step["tools/calls"], step["tools/errors"], step["tools/success_rate"]) == (3, 1, 2 / 3)
    assert step["num_turns/mean"] == 1.75
    assert step["tokenization/retokenize_mismatch_rate"] == 0.25
    assert step["tokenization/template_mismatch_rate"] == 0.25
    assert abs(step["health/first_minibatch_ppo_kl"]) < 1e-5
    assert step["health/first_minibatch_alarm"] == 0
    assert "val/calc_multiturn/score" in step and "reward/turn_reward_mean" in step
    for key in ("agent/called_tool", "agent/tool_then_correct"):  # training and validation
        assert 0.0 <= step[key] <= 1.0 and 0.0 <= step[f"val/{key}"] <= 1.0, key
    assert step["val/agent/tool_then_correct"] <= step["val/agent/called_tool"]

    dump = [json.loads(line) for line in (out / "rollouts" / "step_000002.jsonl").open()]
    extra = dump[1]["reward_extra"]
    assert extra["tokenization_drift"]["retokenize"]["ids_tokens"][:3] == ["th", "ink", ">"]
    assert extra["tool_calls"][0]["output"] == "7"
    returns = batch["returns"][1][mask[1].bool()].sum().item()
    assert extra["trajectory_score"] == torch.tensor(returns).float().item()
