"""Continuous batching of agent turns (``agent.turn_chunk_tokens``): a turn generated in chunks
continues from its kept KV and its own seed's stream, so it samples the same ids as when
generated whole; turns that arrive while others are generated join the next chunk; each
request's own ``max_new_tokens`` ends its row in the engine (no token sampled past it).

Model: the conftest's tiny random Llama (float32, the real tokenizer's vocabulary) with a set
of 1000 ids declared EOS, so that rows end at different steps. Tolerance: ids equal; log-probs
to 1e-5 (the chunked path adds the same float32 terms in other batch shapes; the turn-cache
tests measure <= 2e-6).
"""

from __future__ import annotations

import asyncio
import dataclasses

import torch

from creditrl.agents.episodes import EpisodeRun
from creditrl.config.schema import RolloutConfig
from creditrl.rollout import HFRolloutEngine
from creditrl.rollout.continuation import EngineTurnGenerator, TurnOutput, TurnRequest
from creditrl.rollout.sampling import advance_seed, counter_uniforms

LOG_PROB_ATOL = 1e-5
EOS_IDS = list(range(6000, 7000))
PROMPTS = [[1, 520, 9, 33, 4001, 77], [1, 12, 13], [1, 900, 901, 902, 903, 904, 905]]


def engine(model, tokenizer) -> HFRolloutEngine:
    cfg = RolloutConfig(max_response_length=40, temperature=1.0, micro_batch_size=8)
    return HFRolloutEngine(model, tokenizer, cfg, seed=0, eos_token_ids=EOS_IDS)


def requests(caps: list[int]) -> list[TurnRequest]:
    return [
        TurnRequest(list(p), cap, sample=i, turn=1, seed=1000 * i + 7)
        for i, (p, cap) in enumerate(zip(PROMPTS, caps, strict=True))
    ]


def in_chunks(turns: EngineTurnGenerator, asked: list[TurnRequest]) -> tuple[list, int]:
    """Every request generated to its end in calls of ``turns.chunk_tokens``; (outputs, calls)."""
    ids = [[] for _ in asked]
    log_probs = [[] for _ in asked]
    going, calls = list(range(len(asked))), 0
    while going:
        calls += 1
        batch = []
        for i in going:
            r = asked[i]
            left = r.max_new_tokens - len(ids[i])
            batch.append(
                dataclasses.replace(r, ids=r.ids + ids[i], max_new_tokens=left, sampled=len(ids[i]))
            )
        outs = turns.generate_turns(batch)
        still = []
        for i, out in zip(going, outs, strict=True):
            ids[i] += out.ids
            log_probs[i] += out.log_probs
            if not out.done:
                still.append(i)
        going = still
    return [TurnOutput(a, b) for a, b in zip(ids, log_probs, strict=True)], calls


def test_advance_seed_continues_the_stream() -> None:
    seeds = torch.tensor([7, 123456789, 2**62 - 1])
    for k in (1, 5, 1000):
        moved = torch.tensor([advance_seed(int(s), k) for s in seeds])
        for step in (0, 3):
            assert torch.equal(counter_uniforms(moved, step), counter_uniforms(seeds, step + k))


def test_chunked_turns_sample_what_whole_turns_sample(model, tokenizer) -> None:
    """Chunks of 4 tokens over caps of 25, 3 and 17: the same ids as whole turns, log-probs to
    LOG_PROB_ATOL, rows ending at EOS or at their own cap; more calls than one."""
    caps = [25, 3, 17]
    whole = EngineTurnGenerator(engine(model, tokenizer), tokenizer).generate_turns(requests(caps))
    chunked = EngineTurnGenerator(engine(model, tokenizer), tokenizer, chunk_tokens=4)
    got, calls = in_chunks(chunked, requests(caps))
    assert calls > 2
    ended_at_eos = 0
    for a, b, cap in zip(got, whole, caps, strict=True):
        assert a.ids == b.ids
        assert len(a.ids) <= cap
        ended_at_eos += a.ids[-1] in EOS_IDS
        torch.testing.assert_close(
            torch.tensor(a.log_probs), torch.tensor(b.log_probs), atol=LOG_PROB_ATOL, rtol=0
        )
    assert ended_at_eos >= 1 and any(len(a.ids) == cap for a, cap in zip(got, caps, strict=True))


def test_the_engine_stops_each_row_at_its_own_cap(model, tokenizer) -> None:
    """Caps 2, 5 and 1: each row samples at most its cap (the engine's budget is 40), the
    same ids as the prefix an uncapped call samples."""
    turns = EngineTurnGenerator(engine(model, tokenizer), tokenizer)
    long = turns.generate_turns(requests([40, 40, 40]))
    short = turns.generate_turns(requests([2, 5, 1]))
    for a, b, cap in zip(short, long, [2, 5, 1], strict=True):
        assert len(a.ids) <= cap
        assert a.ids == b.ids[: len(a.ids)]
    steps = turns.engine.last_stats["decode_steps"]
    assert steps <= 4  # the call ends once its longest row (5 tokens) has


def test_a_turn_that_arrives_joins_the_running_batch(model, tokenizer) -> None:
    """Two episodes of two turns: episode 0's turns are short (cap 3), episode 1's first is
    long (cap 30, no EOS set). With chunks of 4, episode 0's second turn is generated in a
    call beside episode 1's unfinished first turn; the ids are those of whole turns."""
    cfg = RolloutConfig(max_response_length=40, temperature=1.0, micro_batch_size=8)

    def run(chunk: int) -> tuple[list[list[int]], list[list[tuple[int, int]]]]:
        eng = HFRolloutEngine(model, tokenizer, cfg, seed=0, eos_token_ids=[2])
        turns = EngineTurnGenerator(eng, tokenizer, chunk_tokens=chunk)
        calls: list[list[tuple[int, int]]] = []
        real = turns.generate_turns

        def recording(batch, **kwargs):
            calls.append([(r.sample, r.turn) for r in batch])
            return real(batch, **kwargs)

        turns.generate_turns = recording
        got: list[list[int]] = [[], []]
        caps = {0: [3, 3], 1: [30, 3]}
        holder: list[EpisodeRun] = []

        async def episode(i: int) -> None:
            ids = list(PROMPTS[i])
            for turn in (1, 2):
                request = TurnRequest(ids, caps[i][turn - 1], sample=i, turn=turn, seed=11 + i)
                out = await asyncio.wrap_future(holder[0].submit(i, request))
                got[i] += out.ids
                ids = ids + out.ids + [13, 14]

        holder.append(EpisodeRun(2, episode, concurrency=2, timeout_s=120))
        outcomes = holder[0].run(turns)
        assert [o[0] for o in outcomes] == ["ok", "ok"]
        return got, calls

    chunked, calls = run(4)
    whole, _ = run(0)
    assert chunked == whole
    assert any({(0, 2), (1, 1)} <= set(call) for call in calls)


def test_micro_batches_of_different_widths_assemble(model, tokenizer) -> None:
    """One row per micro-batch, caps 2 and 5: the parts are 2 and 5 columns wide and assemble
    into one batch, each row as a call of its own samples it."""
    cfg = RolloutConfig(max_response_length=40, temperature=1.0, micro_batch_size=1)
    eng = HFRolloutEngine(model, tokenizer, cfg, seed=0, eos_token_ids=[2])
    turns = EngineTurnGenerator(eng, tokenizer, keep_kv_cache=False)
    both = turns.generate_turns(requests([2, 5, 3]))
    assert [len(o.ids) for o in both] == [2, 5, 3]
    alone = [turns.generate_turns([r])[0] for r in requests([2, 5, 3])]
    assert [o.ids for o in both] == [o.ids for o in alone]
