"""Tokenization drift detectors (spec 004): a non-canonical token path is reported by both the
re-tokenization and the template check, canonical trajectories by neither, and the
``creditrl check-tokenization`` command shows both cases."""

import pytest
import torch

from creditrl.agents.chat import ChatFormat
from creditrl.agents.drift import check_batch, first_divergence, retokenize_check, template_check
from creditrl.cli import main
from creditrl.commands.check_tokenization import demo_batch, demo_scripts
from creditrl.models import load_tokenizer
from creditrl.models.tiny import tiny_model_dir
from creditrl.rollout import StrategyTraits, register_rollout_strategy

SCRIPTED: list = []  # the rollouts the scripted strategy built


@register_rollout_strategy("test_scripted_drift", StrategyTraits(multi_turn=True, uses_tools=True))
def scripted_drift(engine, tokenizer, cfg):
    """The demo's two forced trajectories (one with a non-canonical "<think>") as a registered
    rollout strategy around the run's engine."""
    from creditrl.agents.rollout import AgentRollout
    from creditrl.agents.scripted import ScriptedTurnGenerator

    turns = ScriptedTurnGenerator(demo_scripts(tokenizer), [tokenizer.eos_token_id])
    rollout = AgentRollout(engine, tokenizer, cfg.agent, cfg.rollout, turn_generator=turns)
    SCRIPTED.append(rollout)
    return rollout


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(tiny_model_dir())


def non_canonical_think(tok) -> list[int]:
    vocab = tok.get_vocab()
    return [vocab["<"], vocab["th"], vocab["ink"], vocab[">"]]


def test_retokenize_check(tok) -> None:
    canonical = tok.encode("<think>2+2</think><answer>4</answer>")
    assert retokenize_check(canonical, tok) is None
    odd = non_canonical_think(tok) + tok.encode("ok")
    found = retokenize_check(odd, tok)
    assert found is not None and found.index == 1
    assert found.tokens[:3] == ["th", "ink", ">"] and found.other_tokens[:2] == ["think", ">"]
    assert found.text == found.other_text == "think>ok"
    assert (found.length, found.other_length) == (len(odd), len(odd) - 1)
    report = found.as_dict(("ids", "reencoded"))
    assert report["ids_tokens"][:2] == ["th", "ink"] and report["reencoded_span"][0] == 17400


def test_first_divergence_of_prefixes(tok) -> None:
    found = first_divergence([1, 2, 3], [1, 2], tok)
    assert (found.index, found.ids, found.other_ids) == (2, [3], [])
    assert first_divergence([5, 6], [5, 6], tok) is None


def test_template_check(tok) -> None:
    chat = ChatFormat(tok)
    messages = [{"role": "user", "content": "Hi"}]
    prompt = chat.ids(messages, add_generation_prompt=True)
    reply = [*tok.encode("<think>x</think>done"), tok.eos_token_id]
    final = [*messages, {"role": "assistant", "content": "<think>x</think>done"}]
    assert template_check(prompt, reply, final, chat) is None
    # stopped at the budget without EOS: the template's closing text is not a mismatch
    assert template_check(prompt, reply[:-1], final, chat) is None
    odd = non_canonical_think(tok) + tok.encode("x</think>done") + [tok.eos_token_id]
    found = template_check(prompt, odd, final, chat)
    assert found is not None and found.index == len(prompt) + 1
    assert found.tokens[:2] == ["th", "ink"] and found.other_tokens[0] == "think"


def test_check_batch_on_the_demo_trajectories(tok) -> None:
    batch, rollout = demo_batch(tok)
    metrics, reports = check_batch(batch, rollout.loop.chat)
    assert metrics["tokenization/retokenize_mismatch_rate"] == 0.5
    assert metrics["tokenization/template_mismatch_rate"] == 0.5
    assert reports[0] == {"retokenize": None, "template": None}
    assert reports[1]["retokenize"]["ids_tokens"][:3] == ["th", "ink", ">"]
    assert reports[1]["template"]["accumulated_tokens"][:3] == ["th", "ink", ">"]
    # the ids the policy produced are kept: the non-canonical path is in the batch as sampled
    row = batch["responses"][1].tolist()
    think = non_canonical_think(tok)
    assert any(row[i : i + 4] == think for i in range(len(row)))
    only_first, picked = check_batch(batch, rollout.loop.chat, [0])
    assert only_first["tokenization/retokenize_mismatch_rate"] == 0 and picked[1] is None


def test_check_batch_skips_template_for_cut_observations(tok) -> None:
    batch, rollout = demo_batch(tok)
    batch["agent_info"] = [dict(i, observation_truncated=True) for i in batch["agent_info"]]
    metrics, reports = check_batch(batch, rollout.loop.chat)
    assert metrics["tokenization/template_checked"] == 0
    assert reports[0]["template"] == "skipped"


def test_check_tokenization_cli_demo(capsys) -> None:
    model = f"model.path={tiny_model_dir()}"
    assert main(["check-tokenization", "--demo", model]) == 0
    out = capsys.readouterr().out
    assert "tokenization/retokenize_mismatch_rate: 0.5" in out
    assert "'th', 'ink', '>'" in out and "ok" in out
    assert main(["check-tokenization", "--demo", "--strict", model]) == 1


def test_check_tokenization_cli_with_a_model(capsys) -> None:
    args = [
        "check-tokenization",
        f"model.path={tiny_model_dir()}",
        "data.task=calc_multiturn",
        "data.train_size=4",
        "data.val_size=1",
        "data.system_prompt=Use the calculator.",
        "rollout.max_response_length=12",
        "agent.max_tokens_per_turn=6",
        "--rows",
        "3",
    ]
    torch.manual_seed(0)
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "tokenization/checked: 3" in out and "tokenization/template_checked: 3" in out


CALC = [
    f"model.path={tiny_model_dir()}", "data.task=calc_multiturn", "data.train_size=4",
    "data.val_size=1", "data.system_prompt=Use the calculator.", "agent.tools=[calculator]",
]  # fmt: skip


def test_check_tokenization_runs_the_rollout_strategy_the_run_selects(capsys) -> None:
    """check-tokenization builds the run's rollout (``rollout.strategy``, as the trainer and
    the async sampler do) over the run's datasets: a registered strategy forcing one canonical
    and one non-canonical trajectory is what it checks (before, it always ran the built-in
    agent loop over the engine's own samples)."""
    SCRIPTED.clear()
    args = ["check-tokenization", *CALC, "rollout.strategy=test_scripted_drift",
            "rollout.max_response_length=256", "--rows", "2"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert len(SCRIPTED) == 1
    assert "tokenization/retokenize_mismatch_rate: 0.5" in out, out
    assert "'th', 'ink', '>'" in out
    rollout = SCRIPTED[0]
    first = rollout.tokenizer.decode(rollout.turns.requests[0].ids)
    assert "Use the calculator." in first and "What is" in first  # a calc_multiturn row


def test_check_tokenization_of_a_single_turn_config_checks_the_agent_loop(capsys) -> None:
    """A config whose run samples one answer per prompt (agent.enable=false and no program
    or environment) has no multi-turn trajectory: the command says so in one line and checks
    the built-in agent loop's trajectories, as it always did for such a config."""
    torch.manual_seed(0)
    args = ["check-tokenization", *CALC, "rollout.max_response_length=12",
            "agent.max_tokens_per_turn=6", "--rows", "2"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "rollout strategy is single_turn" in out and "agent.enable=true" in out
    assert "tokenization/checked: 2" in out
