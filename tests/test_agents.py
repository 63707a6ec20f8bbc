"""The token-in-token-out agent loop with forced (scripted) token ids: tool round trips, masks,
turn ids, every ending, structured rewards, multi-turn GRPO, and that observation tokens get no
reward, KL, advantage or loss."""

import asyncio

import pytest
import torch

from creditrl.agents.chat import ChatFormat
from creditrl.agents.parsing import parse_tool_calls
from creditrl.agents.rewards import (
    STRUCTURED_SCORERS,
    StructuredRewardManager,
    trajectory_scores,
)
from creditrl.agents.rollout import AgentRollout
from creditrl.agents.scripted import ScriptedTurnGenerator
from creditrl.agents.task_rewards import (
    AgentSample,
    calc_structured_reward,
    kgqa_structured_reward,
)
from creditrl.batch import Batch
from creditrl.config.schema import AgentConfig, RewardConfig, RolloutConfig
from creditrl.core import apply_kl_penalty, compute_advantage, compute_gae_advantage_return
from creditrl.core.policy_losses import compute_policy_loss_ppo
from creditrl.data import chat_prompt_ids, collate_prompts
from creditrl.models import load_tokenizer
from creditrl.models.tiny import tiny_model_dir
from creditrl.rollout.continuation import cut_at_stop
from creditrl.tools import Tool, build_registry
from creditrl.tracking.health import FirstMinibatchMonitor, first_minibatch_warning

EOS = 2
CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>'
OBS_84 = "\n<|im_start|>tool\n84<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(tiny_model_dir())


def enc(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def prompts(tok, n: int, uids: list[str] | None = None) -> Batch:
    messages = [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "12*7?"}]
    row = {
        "input_ids": chat_prompt_ids(tok, messages),
        "raw_prompt": messages,
        "ground_truth": "84",
        "data_source": "calc_multiturn",
        "extra_info": {},
        "index": 0,
    }
    batch = collate_prompts([row] * n, tok.pad_token_id)
    batch["uid"] = uids or [f"u{i}" for i in range(n)]
    return batch


def run(tok, scripts, tools=None, budget: int = 200, model=None, **agent):
    cfg = AgentConfig(enable=True, **agent)
    generator = ScriptedTurnGenerator(scripts, [EOS], model=model)
    rollout = AgentRollout(
        None,
        tok,
        cfg,
        RolloutConfig(max_response_length=budget),
        tools=tools,
        turn_generator=generator,
    )
    return rollout.generate(prompts(tok, len(scripts))), rollout


def test_parse_tool_calls() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call> and '
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>'
        "<tool_call>{not json}</tool_call><tool_call>[1]</tool_call><tool_call>"
        '{"name": "c"'
    )
    calls = parse_tool_calls(text)
    assert [(c.name, c.arguments) for c in calls[:2]] == [("a", {"x": 1}), ("b", {"y": 2})]
    assert "invalid JSON" in calls[2].error
    assert 'must be {"name"' in calls[3].error
    assert calls[4].error == "<tool_call> is never closed by </tool_call>"
    assert parse_tool_calls("<answer>3</answer>") == []
    assert parse_tool_calls('<tool_call>{"name": "a"}</tool_call>')[0].arguments == {}


@pytest.mark.parametrize("inner", ["[" * 50_000 + "]" * 50_000, "[]," * 20_000 + "1"])
def test_deep_or_wide_tool_call_json_is_an_error_call(inner: str) -> None:
    """Model-written JSON nested 50,000 deep (before: a RecursionError that ended the run) or
    of 40,000 elements is a malformed call, in the block and in an arguments string."""
    for text in (
        f'<tool_call>{{"name": "a", "arguments": [{inner}]}}</tool_call>',
        f'<tool_call>{{"name": "a", "arguments": "[{inner}]"}}</tool_call>',
        f"<tool_call>[{inner}]</tool_call>",
    ):
        (call,) = parse_tool_calls(text)
        assert not call.ok and "above the limit of" in call.error, call.error


def test_chat_format_renders_only_the_new_tool_messages(tok) -> None:
    chat = ChatFormat(tok)
    assert chat.closing_text == "<|im_end|>\n"
    tool = [{"role": "tool", "content": "84"}]
    assert chat.observation_text(tool, "<|im_end|>") == OBS_84
    assert chat.observation_text(tool, None) == "<|im_end|>" + OBS_84
    assert chat.observation_ids(tool, "<|im_end|>") == enc(tok, OBS_84)


def test_tool_round_trip(tok) -> None:
    turn1, turn2 = [*enc(tok, CALL), EOS], [*enc(tok, "<answer>84</answer>"), EOS]
    batch, rollout = run(tok, [[turn1, turn2]])
    obs = enc(tok, OBS_84)
    expected = turn1 + obs + turn2
    n1, n_obs, n = len(turn1), len(obs), len(expected)
    assert batch["responses"][0].tolist() == expected
    assert batch["response_mask"][0].tolist() == [1] * n1 + [0] * n_obs + [1] * len(turn2)
    assert batch["turn_ids"][0].tolist() == [1] * (n1 + n_obs) + [2] * len(turn2)
    log_probs = batch["rollout_log_probs"][0]
    assert (log_probs[n1 : n1 + n_obs] == 0).all()
    assert (log_probs[:n1] == -0.5).all() and (log_probs[n1 + n_obs :] == -0.5).all()
    p = batch["prompts"].shape[1]
    assert batch["input_ids"][0, p:].tolist() == expected
    assert batch["input_ids"][0, :p].tolist() == batch["prompts"][0].tolist()
    assert batch["attention_mask"][0, p:].tolist() == [1] * n
    assert batch["position_ids"][0, -1].item() == p + n - 1
    assert batch["num_turns"].tolist() == [2]
    [record] = batch["tool_calls"][0]
    assert (record["name"], record["status"], record["output"]) == ("calculator", "ok", "84")
    assert batch["agent_info"][0]["stop_reason"] == "answer"
    traj = rollout.last_trajectories[0]
    assert traj.turn_token_ids[0] + traj.observation_token_ids[0] + traj.turn_token_ids[1] == (
        expected
    )
    assert batch["messages"][0][-3:] == [
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": "84", "name": "calculator"},
        {"role": "assistant", "content": "<answer>84</answer>"},
    ]
    assert rollout.loop.last_engine_calls == 2
    # the second turn was generated from exactly the ids accumulated so far
    request = rollout.turns.requests[1]
    assert request.ids == batch["prompts"][0].tolist() + turn1 + obs
    assert (request.sample, request.turn) == (0, 2)
    metrics = rollout.last_metrics
    assert (metrics["tools/calls"], metrics["tools/success_rate"]) == (1.0, 1.0)
    assert metrics["agent/observation_tokens_mean"] == n_obs


def test_failed_calls_become_observations_and_the_episode_goes_on(tok) -> None:
    async def slow(seconds: float) -> str:
        """Sleep."""
        await asyncio.sleep(seconds)
        return "late"

    tools = build_registry(["calculator"], timeout_s=0.1)
    tools.register(Tool.from_function(slow))
    answer = [*enc(tok, "<answer>84</answer>"), EOS]
    bad_json = [*enc(tok, '<tool_call>{"name": calculator}</tool_call>'), EOS]
    unknown = [*enc(tok, '<tool_call>{"name": "weather", "arguments": {}}</tool_call>'), EOS]
    timeout = [*enc(tok, '<tool_call>{"name": "slow", "arguments": {"seconds": 5}}</tool_call>')]
    bad_args = [*enc(tok, '<tool_call>{"name": "calculator", "arguments": {"x": 1}}</tool_call>')]
    scripts = [[bad_json, answer], [unknown, answer], [timeout, answer], [bad_args, answer]]
    batch, rollout = run(tok, scripts, tools=tools)
    statuses = [[c["status"] for c in calls] for calls in batch["tool_calls"]]
    assert statuses == [["malformed"], ["unknown_tool"], ["timeout"], ["bad_arguments"]]
    outputs = [calls[0]["output"] for calls in batch["tool_calls"]]
    assert outputs[0].startswith("Error: malformed tool call: invalid JSON")
    assert "available tools: ['calculator', 'slow']" in outputs[1]
    assert "timed out" in outputs[2] and "unknown argument(s) ['x']" in outputs[3]
    for i, info in enumerate(batch["agent_info"]):
        assert (info["stop_reason"], info["num_turns"]) == ("answer", 2)
        responses, mask = batch["responses"][i], batch["response_mask"][i]
        observation = responses[(mask == 0) & (batch["turn_ids"][i] == 1)].tolist()
        assert outputs[i] in tok.decode(observation)
    # no EOS sampled after the call: the template's end-of-turn is part of the observation
    assert tok.decode(responses[(mask == 0) & (batch["turn_ids"][3] == 1)].tolist()).startswith(
        "<|im_end|>\n<|im_start|>tool\n"
    )
    metrics = rollout.last_metrics
    assert metrics["tools/calls"] == 4 and metrics["tools/success_rate"] == 0
    assert (metrics["tools/errors"], metrics["tools/timeouts"]) == (3, 1)
    assert metrics["tools/status/malformed"] == metrics["tools/status/unknown_tool"] == 1


def test_max_turns_stops_without_running_the_last_calls(tok) -> None:
    turn = [*enc(tok, CALL), EOS]
    batch, _ = run(tok, [[turn, turn, turn]], max_turns=2)
    info = batch["agent_info"][0]
    assert (info["stop_reason"], info["num_turns"]) == ("max_turns", 2)
    assert len(batch["tool_calls"][0]) == 1
    assert batch["responses"][0].tolist() == turn + enc(tok, OBS_84) + turn


def test_length_budget_cuts_the_observation_and_stops(tok) -> None:
    turn = [*enc(tok, CALL), EOS]
    budget = len(turn) + 5
    batch, _ = run(tok, [[turn, turn]], budget=budget)
    info = batch["agent_info"][0]
    assert (info["stop_reason"], info["observation_truncated"]) == ("length", True)
    assert batch["responses"].shape[1] == budget
    assert batch["responses"][0].tolist() == turn + enc(tok, OBS_84)[:5]
    short, _ = run(tok, [[turn]], budget=6)
    assert short["agent_info"][0]["stop_reason"] == "length"
    assert short["responses"][0].tolist() == turn[:6]


def test_calls_per_turn_cap_and_truncated_output(tok) -> None:
    three = [*enc(tok, CALL * 3), EOS]
    batch, _ = run(
        tok, [[three]], max_calls_per_turn=2, tool_output_max_chars=1, truncate_side="right"
    )
    calls = batch["tool_calls"][0]
    assert [c["status"] for c in calls] == ["ok", "ok", "skipped"]
    assert calls[0]["output"] == "8...[1 chars truncated]..."


def test_state_masking_off_uses_the_attention_mask(tok) -> None:
    turns = [[*enc(tok, CALL), EOS], [*enc(tok, "<answer>84</answer>"), EOS]]
    batch, _ = run(tok, [turns], state_masking=False)
    n = batch["responses"].shape[1]
    assert batch["response_mask"][0].tolist() == [1] * n
    assert (batch["rollout_log_probs"][0] == 0).sum() == len(enc(tok, OBS_84))


def test_cut_at_stop(tok) -> None:
    ids = enc(tok, "abc</tool_call> more text")
    k = cut_at_stop(ids, tok, ["</tool_call>"])
    assert tok.decode(ids[:k]).endswith("</tool_call>") and k < len(ids)
    assert cut_at_stop(ids, tok, ["zzz"]) == len(ids)


def _structured_batch(tok) -> Batch:
    responses = torch.tensor([[11, 12, 13, 14, 15, 2]])
    return Batch(
        {
            "responses": responses,
            "response_mask": torch.tensor([[1, 1, 0, 0, 1, 0]]),
            "turn_ids": torch.tensor([[1, 1, 1, 1, 2, 0]]),
        },
        {"data_source": ["fixed_structured"], "ground_truth": [None]},
    )


def _fixed(sample: AgentSample, **_: object) -> dict:
    return {"turn_rewards": {1: 0.2, 2: 0.4}, "global_rewards": {"a": 0.3, "_raw_a": 5.0}}


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("turn_proportional", [[0.2, 0.2, 0.0, 0.0, 0.5, 0.0]]),
        ("final_token_only", [[0.0, 0.0, 0.0, 0.0, 0.6, 0.0]]),
    ],
)
def test_structured_rewards_to_tokens(tok, monkeypatch, mode: str, expected: list) -> None:
    monkeypatch.setitem(STRUCTURED_SCORERS, "fixed_structured", _fixed)
    manager = StructuredRewardManager(RewardConfig(), AgentConfig(reward_distribution=mode), tok)
    batch = _structured_batch(tok)
    result = manager.submit(batch).result()
    # turn_proportional: turn 1's 0.2 over its 2 policy tokens, turn 2's 0.4 on its 1 token,
    # the counted global 0.3 over the 3 policy tokens; final: mean(0.2, 0.4) + 0.3 = 0.6
    torch.testing.assert_close(result.token_level_scores, torch.tensor(expected))
    torch.testing.assert_close(result.scores, torch.tensor([0.6]))
    result.write_to(batch)
    torch.testing.assert_close(batch["turn_scores"], torch.tensor([0.3]))
    torch.testing.assert_close(batch["global_scores"], torch.tensor([0.3]))
    assert batch["structured_rewards"][0]["global_rewards"]["_raw_a"] == 5.0
    assert result.metrics["reward/a_mean"] == pytest.approx(0.3)


def _sample(turns: list[str], calls: list[dict], truth) -> AgentSample:
    from creditrl.agents.parsing import extract_answer

    return AgentSample(
        "kgqa",
        truth,
        [{"turn": k, "text": t, "answer": extract_answer(t)} for k, t in enumerate(turns, 1)],
        calls,
    )


def test_kgqa_reward_uses_spec001_components_and_weights() -> None:
    lookup = '<tool_call>{"name": "kg_lookup", "arguments": {"entity": "Japan"}}</tool_call>'
    record = {"turn": 1, "name": "kg_lookup", "status": "ok", "output": "Japan | capital | Tokyo"}
    good = kgqa_structured_reward(_sample([lookup, "<answer>Tokyo</answer>"], [record], ["Tokyo"]))
    # turn 1: validity 0.1 + format 0.15; turn 2: answer 0.1 + format 0.15; global 0.3 + 0.4
    assert good["turn_rewards"] == pytest.approx({1: 0.25, 2: 0.25})
    assert good["global_rewards"] == pytest.approx(
        {
            "exact_match": 0.3,
            "retrieval_quality": 0.4,
            "_raw_exact_match": 1.0,
            "_raw_retrieval_quality": 1.0,
        }
    )
    empty = {**record, "output": "No facts found for 'Japn'."}
    bad = kgqa_structured_reward(
        _sample([lookup + " <answer>x</answer>", "<answer>Kyoto</answer>"], [empty], ["Tokyo"])
    )
    # turn 1 mixes a call and an answer (format 0) and its lookup found nothing (validity 0)
    assert bad["turn_rewards"] == pytest.approx({1: 0.0, 2: 0.25})
    assert bad["global_rewards"]["exact_match"] == bad["global_rewards"]["retrieval_quality"] == 0


def test_calc_reward() -> None:
    record = {"turn": 1, "name": "calculator", "status": "ok", "output": "84"}
    out = calc_structured_reward(_sample([CALL, "<answer>84</answer>"], [record], "84"))
    assert out["turn_rewards"] == pytest.approx({1: 0.25, 2: 0.25})
    assert out["global_rewards"]["exact_match"] == 1.0 and out["global_rewards"]["tool_use"] == 0.2
    weighted = calc_structured_reward(
        _sample(["<answer>85</answer>"], [], "84"), weights={"exact_match": 2.0}
    )
    assert weighted["turn_rewards"] == pytest.approx({1: 0.25})
    assert weighted["global_rewards"]["exact_match"] == 0.0
    with pytest.raises(KeyError, match="unknown reward weight 'typo'"):
        calc_structured_reward(_sample(["x"], [], "1"), weights={"typo": 1.0})


def test_observation_tokens_get_no_reward_kl_advantage_or_loss(tok) -> None:
    turns = [[*enc(tok, CALL), EOS], [*enc(tok, "<answer>84</answer>"), EOS]]
    wrong = [turns[0], [*enc(tok, "<answer>85</answer>"), EOS]]
    batch, _ = run(tok, [turns, wrong, turns, turns])
    batch["uid"] = ["a", "a", "b", "b"]
    manager = StructuredRewardManager(
        RewardConfig(), AgentConfig(reward_distribution="turn_proportional"), tok
    )
    manager.submit(batch).result().write_to(batch)
    mask = batch["response_mask"]
    obs = (mask == 0) & (batch["attention_mask"][:, -mask.shape[1] :] == 1)
    assert obs.any() and (batch["token_level_scores"][obs] == 0).all()
    torch.manual_seed(0)
    old, ref = torch.randn(mask.shape), torch.randn(mask.shape)
    rewards, _ = apply_kl_penalty(batch["token_level_scores"], old, ref, mask, 0.5)
    assert (rewards[obs] == 0).all() and (rewards[mask.bool()] != 0).any()
    values = torch.randn(mask.shape)
    adv, returns = compute_advantage("gae", rewards, mask, values=values, gamma=0.9, lam=0.8)
    assert (adv[obs] == 0).all() and (returns[obs] == 0).all()
    # GAE across an observation span equals GAE with the span removed
    raw, _ = compute_gae_advantage_return(rewards, values, mask, 0.9, 0.8, whiten=False)
    keep = mask[0].bool()
    alone, _ = compute_gae_advantage_return(
        rewards[:1, keep], values[:1, keep], mask[:1, keep], 0.9, 0.8, whiten=False
    )
    torch.testing.assert_close(raw[0, keep], alone[0])
    for name in ("grpo", "rloo", "reinforce_plus_plus"):
        adv, _ = compute_advantage(name, rewards, mask, batch["uid"])
        assert (adv[obs] == 0).all() and (adv[mask.bool()] != 0).any(), name
    # the policy loss does not see anything at observation positions
    log_prob, adv = torch.randn(mask.shape), torch.randn(mask.shape)
    loss, _ = compute_policy_loss_ppo(old, log_prob, adv, mask)
    noisy = [t.masked_fill(obs, 123.0) for t in (old, log_prob, adv)]
    torch.testing.assert_close(compute_policy_loss_ppo(*noisy, mask)[0], loss)


def test_grpo_multiturn_normalises_turn_and_global_parts_separately() -> None:
    mask = torch.tensor([[1, 0, 1], [1, 1, 0], [1, 1, 1], [1, 1, 1]])
    turn, glob = torch.tensor([0.2, 0.4, 0.1, 0.5]), torch.tensor([1.0, 1.0, 0.0, 2.0])
    adv, returns = compute_advantage(
        "grpo_multiturn",
        torch.zeros(4, 3),
        mask,
        ["a", "a", "b", "c"],
        turn_scores=turn,
        global_scores=glob,
    )
    # group a: z(turn) = -+0.1 / (std 0.1414 + eps), z(global) = 0; groups b, c alone: 0
    z = 0.1 / (0.02**0.5 + 1e-6)
    torch.testing.assert_close(adv[:, 0], torch.tensor([-z, z, 0.0, 0.0]))
    assert (adv[mask == 0] == 0).all() and torch.equal(adv, returns)
    pair = compute_advantage(
        "grpo_multiturn",
        torch.zeros(2, 1),
        torch.ones(2, 1),
        ["a", "a"],
        turn_scores=torch.tensor([0.0, 1.0]),
        global_scores=torch.tensor([1.0, 0.0]),
        norm_adv_by_std_in_grpo=False,
    )[0]
    torch.testing.assert_close(pair[:, 0], torch.tensor([0.0, 0.0]))
    # without structured parts the outcome score is the global part: plain GRPO
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.0, 0.0], [0.2, 0.0, 0.0], [1.0, 0.0, 0.0]])
    torch.testing.assert_close(
        compute_advantage("grpo_multiturn", rewards, mask, ["a", "a", "b", "b"])[0],
        compute_advantage("grpo", rewards, mask, ["a", "a", "b", "b"])[0],
    )


def test_trajectory_scores_sum_returns_over_the_loss_mask() -> None:
    returns = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1, 0, 1], [0, 0, 1]])
    torch.testing.assert_close(trajectory_scores(returns, mask), torch.tensor([4.0, 6.0]))
    torch.testing.assert_close(
        trajectory_scores(torch.tensor([1.5]), mask[:1]), torch.tensor([1.5])
    )


def test_first_minibatch_health_check() -> None:
    quiet = {"health/first_minibatch_ppo_kl": 2e-5, "health/first_minibatch_clipfrac": 0.0}
    assert first_minibatch_warning(quiet) is None
    loud = {"health/first_minibatch_ppo_kl": 0.05, "health/first_minibatch_clipfrac": 0.1}
    text = first_minibatch_warning(loud)
    for cause in ("log-prob mismatch", "re-tokenisation", "dropout", "temperature"):
        assert cause in text
    assert first_minibatch_warning(loud, on_policy=False) is None
    monitor = FirstMinibatchMonitor()
    first, second = dict(loud), dict(loud)
    assert monitor.check(first) == text and monitor.check(second) is None
    assert (second["health/first_minibatch_alarm"], second["health/first_minibatch_alarms"]) == (
        1.0,
        2.0,
    )
    assert monitor.check({}) is None


def test_engine_turn_generator_continues_the_given_ids(tok) -> None:
    from creditrl.models import load_causal_lm
    from creditrl.rollout import HFRolloutEngine
    from creditrl.rollout.continuation import EngineTurnGenerator, TurnRequest

    model = load_causal_lm(tiny_model_dir()).eval()
    engine = HFRolloutEngine(model, tok, RolloutConfig(max_response_length=16, temperature=1.0))
    generator = EngineTurnGenerator(engine, tok, max_tokens_per_turn=5)
    assert generator.turn_engine.cfg.max_response_length == 5
    assert generator.turn_engine.generator is engine.generator
    context = chat_prompt_ids(tok, [{"role": "user", "content": "hi"}])
    requests = [TurnRequest(context, 5, seed=7), TurnRequest([*context, 44, 373], 3, seed=8)]
    outs = generator.generate_turns(requests)
    assert len(outs[0].ids) == 5 and len(outs[1].ids) == 3
    # per-turn seeds: a turn's samples do not depend on the other requests of its batch
    assert generator.generate_turns([requests[1]])[0].ids == outs[1].ids
    # log-probs of the new ids given exactly the context ids, at the sampling temperature
    with torch.no_grad():
        logits = model(torch.tensor([context + outs[0].ids])).logits[0, len(context) - 1 : -1]
    expected = logits.log_softmax(-1).gather(-1, torch.tensor(outs[0].ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(outs[0].log_probs), expected, atol=1e-4, rtol=0)


def test_demo_task_datasets(tok) -> None:
    from creditrl.agents.tasks import build_agent_datasets
    from creditrl.config.loader import load_config

    calc = load_config(
        overrides=["preset=calculator_agent", "data.train_size=6", "data.val_size=2"]
    )
    train, val = build_agent_datasets(calc, tok)
    assert (len(train), len(val)) == (6, 2)
    row = train[0]
    roles = [m["role"] for m in row["raw_prompt"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "user"]
    assert '"name": "calculator"' in row["raw_prompt"][0]["content"]
    question = row["raw_prompt"][-1]["content"]
    assert question.startswith("What is ") and question.endswith("?")
    assert row["data_source"] == "calc_multiturn" and row["ground_truth"].lstrip("-").isdigit()
    kgqa = load_config(overrides=["preset=kgqa", "data.task_kwargs.few_shot=false"])
    train, val = build_agent_datasets(kgqa, tok)
    assert (len(train), len(val)) == (32, 8)
    assert [m["role"] for m in train[0]["raw_prompt"]] == ["system", "user"]
    assert train[0]["ground_truth"] == ["Tokyo"] and train[0]["data_source"] == "kgqa"


def test_parse_a_list_of_calls_in_one_block() -> None:
    calls = parse_tool_calls(
        '<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b"}, 3]</tool_call>'
    )
    assert [(c.name, c.arguments, c.ok) for c in calls] == [
        ("a", {"x": 1}, True),
        ("b", {}, True),
        (None, None, False),
    ]


def test_health_tolerances_follow_the_update_precision() -> None:
    bf16 = FirstMinibatchMonitor.for_autocast("bf16")
    noise = {"health/first_minibatch_ppo_kl": 0.049, "health/first_minibatch_clipfrac": 0.05}
    assert bf16.check(dict(noise)) is None
    wrong_temperature = {
        "health/first_minibatch_ppo_kl": 0.043,
        "health/first_minibatch_clipfrac": 0.26,
    }
    assert bf16.check(wrong_temperature) is not None
    assert FirstMinibatchMonitor.for_autocast("none").check(dict(noise)) is not None
