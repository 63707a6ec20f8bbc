"""Agent turns that keep each sample's KV cache (``agent.keep_kv_cache``): the same tokens as
re-prefilling the whole context every turn, fewer prefilled tokens, and the
``rollout/prefill_tokens`` metric.

The model is a tiny random Llama (float32) whose logits get a bigram bias (``EDGES``: after
input id a, +bias on the ids listed for a), so that it really calls a tool turn after turn:
after "assistant\\n" it starts ``<tool_call>`` (or, less likely, answers "!" and stops); the
call is never closed, so it is a malformed call whose error message is the observation.
Branches with close biases are decided by the random model's context-dependent logits, so
samples differ in turns and turn lengths; deviations run to the per-turn cap.

Tolerance: token ids must be equal; log-probs agree to atol 1e-5 (float32: the two paths add
the same terms in different batch shapes, measured differences <= 2e-6).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import tiny_llama_config
from transformers import LlamaForCausalLM

from creditrl.agents.rollout import AgentRollout
from creditrl.batch import Batch
from creditrl.config.loader import load_config
from creditrl.config.schema import AgentConfig, RolloutConfig
from creditrl.data import chat_prompt_ids, collate_prompts
from creditrl.models.tiny import tiny_model_dir
from creditrl.pipeline.step import StepPipeline
from creditrl.rollout import HFRolloutEngine, hf_engine
from creditrl.rollout.continuation import EngineTurnGenerator, TurnRequest
from creditrl.rollout.turn_cache import TurnKVCache, common_prefix_length
from creditrl.workers.hybrid import PREFILL_FIELD, HybridWorker

LOG_PROB_ATOL = 1e-5
CAP = 12  # agent.max_tokens_per_turn
NEWLINE, CALL_START, ANSWER, EOS = 198, 44, 17, 2
# "\n" -> "<" (call) or "!" (answer); "<tool_call>" then "x" or " done ok", then EOS
EDGES = {
    NEWLINE: [(CALL_START, 0.0), (ANSWER, -1.0)],
    ANSWER: [(EOS, 0.0)],
    CALL_START: [(19324, 0.0)],
    19324: [(79, 0.0)],
    79: [(4350, 0.0)],
    4350: [(46, 0.0)],
    46: [(104, 0.0), (2294, 0.0)],
    104: [(EOS, 0.0)],
    2294: [(10907, 0.0)],
    10907: [(EOS, 0.0)],
}
QUESTIONS = [
    "1+1?",
    "What is 12 times 7, please?",
    "2*3",
    "Compute the sum of 5, 6 and 7 for me.",
    "9-4?",
    "hi",
]


class BigramForcedLlama(LlamaForCausalLM):
    """Llama whose logits at a position with input id a get ``bias + offset`` added on each
    id of ``EDGES[a]`` (a bigram table on top of the LM head: still a causal LM)."""

    def forward(self, input_ids=None, **kwargs):
        out = super().forward(input_ids=input_ids, **kwargs)
        keep = kwargs.get("logits_to_keep")
        if isinstance(keep, torch.Tensor):  # logits at these positions (a token trie's nodes)
            ids = input_ids[:, keep]
        else:
            ids = input_ids[:, -out.logits.shape[1] :]
        out.logits.scatter_add_(-1, self.follow[ids], self.strength[ids].to(out.logits.dtype))
        return out


def forced_model(bias: float) -> BigramForcedLlama:
    config = tiny_llama_config()
    torch.manual_seed(0)
    model = BigramForcedLlama(config).float().eval()
    model.follow = torch.zeros((config.vocab_size, 2), dtype=torch.long)
    model.strength = torch.zeros((config.vocab_size, 2))
    for a, outs in EDGES.items():
        for j, (b, offset) in enumerate(outs):
            model.follow[a, j], model.strength[a, j] = b, bias + offset
    return model


@pytest.fixture(scope="module")
def model() -> BigramForcedLlama:
    return forced_model(16.0)


def prompt_batch(tok, repeat: int = 1) -> Batch:
    rows = []
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        rows.append(
            {
                "input_ids": chat_prompt_ids(tok, messages),
                "raw_prompt": messages,
                "ground_truth": "1",
                "data_source": "calc_multiturn",
                "extra_info": {},
                "index": 0,
            }
        )
    prompts = collate_prompts(rows, tok.pad_token_id).repeat(repeat, interleave=True)
    prompts["sample_seed"] = torch.arange(len(prompts)) * 1000 + 17
    return prompts


def agent_rollout(model, tok, keep: bool, *, greedy=False, stop=(), repeat=1):
    """(batch, AgentRollout, calls): ``calls`` records each engine call's requests, the
    engine's prefilled tokens and the samples the turn cache holds after it."""
    rollout_cfg = RolloutConfig(max_response_length=160, temperature=1.0, micro_batch_size=4)
    engine = HFRolloutEngine(model, tok, rollout_cfg, seed=0)
    agent_cfg = AgentConfig(
        enable=True, max_turns=4, max_tokens_per_turn=CAP, stop=list(stop), keep_kv_cache=keep
    )
    rollout = AgentRollout(engine, tok, agent_cfg, rollout_cfg)
    turns, calls = rollout.turns, []
    generate_turns = turns.generate_turns

    def recording(requests, **kwargs):
        out = generate_turns(requests, **kwargs)
        held = None if turns.turn_cache is None else set(turns.turn_cache.entries)
        calls.append((list(requests), turns.turn_engine.last_stats["prefill_tokens"], held))
        return out

    turns.generate_turns = recording
    return rollout.generate(prompt_batch(tok, repeat), greedy=greedy), rollout, calls


def distinct(requests: list[TurnRequest]) -> list[TurnRequest]:
    seen, out = set(), []
    for r in requests:
        if tuple(r.ids) not in seen:
            seen.add(tuple(r.ids))
            out.append(r)
    return out


def assert_same_rollout(kept: Batch, fresh: Batch) -> None:
    for name in ("responses", "response_mask", "turn_ids", "num_turns", "attention_mask"):
        assert torch.equal(kept[name], fresh[name]), name
    torch.testing.assert_close(
        kept["rollout_log_probs"], fresh["rollout_log_probs"], atol=LOG_PROB_ATOL, rtol=0
    )


def expected_kept_prefill(requests: list[TurnRequest], rollout: AgentRollout, tail: int) -> int:
    """Tokens a kept-cache call prefills when no turn was cut below what it sampled: turn 1
    the prompt, turn k > 1 the observation of turn k - 1 plus ``tail`` (1: that turn's last
    sampled token, never fed); identical requests are prefilled once."""
    total = 0
    for r in distinct(requests):
        traj = rollout.last_trajectories[r.sample]
        total += (
            len(traj.prompt_ids)
            if r.turn == 1
            else len(traj.observation_token_ids[r.turn - 2]) + tail
        )
    return total


@pytest.mark.parametrize("greedy", [False, True])
def test_kept_cache_samples_the_same_tokens_and_prefills_only_new_ones(
    model, tokenizer, greedy, monkeypatch
) -> None:
    """Six prompts of different lengths (greedy: each twice, so identical samples share a
    prefill): the same ids and, to LOG_PROB_ATOL, log-probs with the cache kept as with
    re-prefilled contexts; each kept-cache turn after the first prefills exactly the previous
    turn's last token and observation, the re-prefilled one the whole context (prompts run
    padded here, not as a token trie, so the count is exact); the cache holds only the samples
    of the latest call and is freed at the end."""
    monkeypatch.setattr(hf_engine, "TREE_PREFILL", False)
    kept, rollout, calls = agent_rollout(model, tokenizer, True, greedy=greedy, repeat=1 + greedy)
    fresh, fresh_rollout, fresh_calls = agent_rollout(
        model, tokenizer, False, greedy=greedy, repeat=1 + greedy
    )
    assert_same_rollout(kept, fresh)
    turns = kept["num_turns"]
    assert int(turns.max()) >= 3 and int(turns.min()) < int(turns.max())
    lengths = [len(ids) for t in rollout.last_trajectories for ids in t.turn_token_ids]
    assert min(lengths) < max(lengths)  # rows left the running batch at different steps

    assert len(calls) == len(fresh_calls) >= 3
    for (requests, prefilled, held), (fresh_requests, fresh_prefilled, _) in zip(
        calls, fresh_calls, strict=True
    ):
        assert [r.ids for r in requests] == [r.ids for r in fresh_requests]
        assert prefilled == expected_kept_prefill(requests, rollout, tail=1)
        assert fresh_prefilled == sum(len(r.ids) for r in distinct(requests))
        assert held == {r.sample for r in requests}
    assert rollout.last_stats["prefill_tokens"] == sum(c[1] for c in calls)
    assert fresh_rollout.last_stats["prefill_tokens"] == sum(c[1] for c in fresh_calls)
    assert rollout.last_stats["prefill_tokens"] < fresh_rollout.last_stats["prefill_tokens"] / 2
    assert len(rollout.turns.turn_cache) == 0 and fresh_rollout.turns.turn_cache is None


def test_turns_cut_at_a_stop_string_crop_the_kept_cache(model, tokenizer) -> None:
    """With stop string ">" every call turn keeps "<tool_call>" and drops what was sampled
    after it, so the kept cache is cut back to the kept ids: the next turn prefills exactly
    the observation (the cut-off tokens are gone, nothing of the turn is re-fed), and the
    rollout equals the re-prefilled one."""
    kept, rollout, calls = agent_rollout(model, tokenizer, True, greedy=True, stop=[">"])
    fresh, _, _ = agent_rollout(model, tokenizer, False, greedy=True, stop=[">"])
    assert_same_rollout(kept, fresh)
    cut = [ids for t in rollout.last_trajectories for ids in t.turn_token_ids if ids[0] == 44]
    assert cut and all(ids == [44, 19324, 79, 4350, 46] for ids in cut)
    assert int(kept["num_turns"].max()) >= 3
    for requests, prefilled, _ in calls[1:]:
        assert prefilled == expected_kept_prefill(requests, rollout, tail=0)


def test_turn_cache_reuses_crops_and_falls_back(model, tokenizer) -> None:
    """The engine's cache directly: a kept entry is the KV of exactly the fed ids (equal to a
    fresh forward's); a continuation prefills only the new tokens and samples what a full
    prefill samples; a diverging context is cropped to the common prefix; no common prefix
    and key None prefill everything; an identical context still feeds its last token."""
    cfg = RolloutConfig(max_response_length=6, temperature=1.0)
    engine = HFRolloutEngine(model, tokenizer, cfg, seed=0)
    cache = TurnKVCache()
    context = chat_prompt_ids(tokenizer, [{"role": "user", "content": "What is 2 + 2?"}])

    def row(ids: list[int], seed: int) -> Batch:
        return Batch.from_dict(
            {
                "input_ids": torch.tensor([ids]),
                "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
                "sample_seed": torch.tensor([seed]),
            }
        )

    def turn(ids: list[int], key: int | None = 0, seed: int = 5) -> Batch:
        return engine.generate_with_turn_cache(row(ids, seed), [key], cache)

    out = turn(context)
    sampled = out["responses"][0, : int(out["response_mask"].sum())].tolist()
    entry = cache.entries[0]
    assert entry.ids == context + sampled[:-1]
    with torch.no_grad():
        reference = model(torch.tensor([entry.ids]), use_cache=True).past_key_values
    for layer, (k, v) in enumerate(zip(entry.keys, entry.values, strict=True)):
        torch.testing.assert_close(k, reference.layers[layer].keys[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(v, reference.layers[layer].values[0], atol=1e-5, rtol=0)

    following = context + sampled + [198, 1, 19324, 198]
    out = turn(following, seed=6)
    assert engine.last_stats["prefill_tokens"] == 5  # last sampled token + 4 new ids
    assert torch.equal(out["responses"], engine.generate(row(following, 6))["responses"])

    stored = cache.entries[0].ids
    diverging = [*stored[: len(context) + 2], 7, 8, 9]
    assert common_prefix_length(stored, diverging) == len(context) + 2
    turn(diverging)
    assert engine.last_stats["prefill_tokens"] == 3
    turn(list(cache.entries[0].ids))
    assert engine.last_stats["prefill_tokens"] == 1
    other = [5, *context]
    turn(other)
    assert engine.last_stats["prefill_tokens"] == len(other)
    turn(other, key=None)
    assert engine.last_stats["prefill_tokens"] == len(other) and set(cache.entries) == {0}


def test_kv_keeping_needs_the_hf_engines_own_generate(model, tokenizer) -> None:
    """``keep_kv_cache=False``, or an HF subclass that overrides generate(), re-prefills
    through generate(); the plain HF engine keeps a TurnKVCache."""
    engine = HFRolloutEngine(model, tokenizer, RolloutConfig(max_response_length=4))

    class Overriding(HFRolloutEngine):
        def generate(self, prompts: Batch, **kwargs: object) -> Batch:
            return super().generate(prompts, **kwargs)

    other = Overriding(model, tokenizer, RolloutConfig(max_response_length=4))
    assert isinstance(EngineTurnGenerator(engine, tokenizer).turn_cache, TurnKVCache)
    assert EngineTurnGenerator(engine, tokenizer, keep_kv_cache=False).turn_cache is None
    assert EngineTurnGenerator(other, tokenizer).turn_cache is None


class _Reward:
    def submit(self, batch: Batch) -> SimpleNamespace:
        result = SimpleNamespace(metrics={"reward/x": 1.0}, write_to=lambda b: None)
        return SimpleNamespace(result=lambda: result)


class _Workers:
    """A worker group of one rollout-role HybridWorker (generate only)."""

    def __init__(self, worker: HybridWorker) -> None:
        self.worker = worker

    def generate(self, prompts: Batch, **kwargs: object) -> Batch:
        return self.worker.generate(prompts, **kwargs)


def test_rollout_prefill_tokens_metric(tmp_path: Path, tokenizer) -> None:
    """The worker's answer carries the engine's prefilled tokens (single-turn: each distinct
    prompt once); the pipeline removes the field and reports ``rollout/prefill_tokens`` for
    the step, summed over the step's generation batches and restarted at the next step."""
    cfg = load_config(
        overrides=[
            f"model.path={tiny_model_dir()}",
            "rollout.max_response_length=4",
            "rollout.n=2",
            f"trainer.output_dir={tmp_path}",
        ]
    )
    worker = HybridWorker(cfg, roles=("rollout",))
    rows = [tokenizer.encode(t) for t in ("What is 3 + 4?", "Name a colour, then stop.")]
    width = max(map(len, rows))
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    prompts = Batch.from_dict({"input_ids": ids, "attention_mask": mask}).repeat(2, interleave=True)
    prompts["data_source"] = ["x"] * 4
    answer = worker.generate(prompts)
    prompt_tokens = sum(map(len, rows))
    assert answer[PREFILL_FIELD].tolist() == [prompt_tokens, 0, 0, 0]

    pipeline = StepPipeline(cfg, _Workers(worker), _Reward(), tokenizer)
    timing: dict[str, float] = {}
    first, future = pipeline.generation_half(prompts, 1, timing)
    assert PREFILL_FIELD not in first
    assert pipeline.score(first, future, timing, "reward")["rollout/prefill_tokens"] == (
        prompt_tokens
    )
    second, future = pipeline.generation_half(prompts, 1, timing)
    metrics = pipeline.score(second, future, timing, "reward")
    assert metrics["rollout/prefill_tokens"] == 2 * prompt_tokens
    third, future = pipeline.generation_half(prompts[:2], 2, timing)
    metrics = pipeline.score(third, future, timing, "reward")
    assert metrics["rollout/prefill_tokens"] == len(rows[0]) and metrics["reward/x"] == 1.0


def test_first_turn_prefills_as_a_token_trie_in_both_paths(model, tokenizer) -> None:
    """The six chat prompts share their template's head: the first turn runs them as one
    token trie whether the KV is kept or not (same pushed count, fewer than their tokens),
    and the greedy rollouts stay equal (sampled ones may part where a draw lands within float
    rounding of a tail token's CDF boundary: the trie's keys differ from the padded ones by
    ~1e-7)."""
    kept, _, calls = agent_rollout(model, tokenizer, True, greedy=True)
    fresh, _, fresh_calls = agent_rollout(model, tokenizer, False, greedy=True)
    assert_same_rollout(kept, fresh)
    first_requests, first_kept, _ = calls[0]
    assert first_kept == fresh_calls[0][1] < sum(len(r.ids) for r in distinct(first_requests))
