"""The decode loop over a static KV cache (``rollout.cuda_graph``): no host sync per step.

Rows never leave the static batch, so the loop keeps every tensor at m rows and writes with
``torch.where``/``masked_fill`` instead of boolean indexing (each of which waits for the
device); the sampler runs inside the step (``StepSampler``, captured with the forward on
CUDA); whether any row is still running is read every ``CHECK_EVERY`` steps only. A step run
after every row finished changes nothing: finished rows record the pad id and log-prob 0.

Draws: a row's uniform at step s is ``counter_uniforms(seed, s)`` with ``sample_seed``, else
the s-th ``torch.rand(m)`` of the engine's generator, as on the dynamic path; the steps run
past the last row's end are taken back (the generator's state is restored to the last check
and advanced by the draws the dynamic path makes), so both paths leave the generator where it
would be and the next micro-batch draws the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from creditrl.rollout.cuda_graph import StaticDecodeStep
from creditrl.rollout.sampling import SamplingParams, counter_uniforms, sample_next_tokens

__all__ = ["CHECK_EVERY", "StepSampler", "static_decode"]

CHECK_EVERY = 16  # steps between reads of "is any row still running" (one host sync each)


@dataclass(frozen=True)
class StepSampler:
    """``sample_next_tokens`` with one call's settings, as a step's sampler (hashable: a step
    keeps one captured graph per sampler)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    greedy: bool
    with_kept: bool

    @classmethod
    def of(cls, params: SamplingParams, with_kept: bool) -> StepSampler:
        """The sampler of ``params``; ``with_kept``: it also gives the kept-set sizes."""
        return cls(
            params.temperature, params.top_k, params.top_p, params.min_p, params.greedy, with_kept
        )

    def __call__(
        self, logits: torch.Tensor, uniforms: torch.Tensor | None
    ) -> tuple[torch.Tensor, ...]:
        return sample_next_tokens(
            logits,
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            greedy=self.greedy,
            uniforms=None if self.greedy else uniforms,
            min_p=self.min_p,
            with_kept=self.with_kept,
        )


class _Draws:
    """Each step's uniforms (m,) of a micro-batch: none (greedy), the rows' counter streams,
    or the engine's generator, which ``settle`` leaves where the dynamic path would."""

    def __init__(
        self,
        m: int,
        device: torch.device,
        greedy: bool,
        seeds: torch.Tensor | None,
        generator: torch.Generator,
    ) -> None:
        self.m, self.device, self.greedy, self.seeds = m, device, greedy, seeds
        self.generator = generator if not greedy and seeds is None else None
        self.checkpoint = (0, self.generator.get_state() if self.generator else None)

    def at(self, step: int) -> torch.Tensor | None:
        if self.greedy:
            return None
        if self.seeds is not None:
            return counter_uniforms(self.seeds, step).to(self.device)
        return torch.rand(self.m, generator=self.generator, device=self.device)

    def check(self, step: int) -> None:
        """Remember the generator's state before step ``step``'s draw."""
        if self.generator is not None:
            self.checkpoint = (step, self.generator.get_state())

    def settle(self, drawn: int, needed: int) -> None:
        """``drawn`` steps drew; the dynamic path draws ``needed`` (>= the checkpoint's)."""
        if self.generator is None or drawn == needed:
            return
        step, state = self.checkpoint
        self.generator.set_state(state)
        for _ in range(needed - step):
            self.at(0)


def static_decode(
    step: StaticDecodeStep,
    logits: torch.Tensor,
    params: SamplingParams,
    max_new: int,
    eos_token_ids: torch.Tensor,
    seeds: torch.Tensor | None,
    caps: torch.Tensor | None,
    with_kept: bool,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """Responses (m, L) padded with the step's pad id, log-probs (m, L), lengths (m,), the
    kept-set sizes (m, L) when ``with_kept`` (else None) and the decode steps run, for m rows
    whose prefill gave next-token ``logits`` (m, V) and whose cache ``step`` holds
    (``StaticDecodeStep.load``); L = ``max_new``, and row i stops at ``caps[i]`` tokens."""
    m, device, pad = len(logits), logits.device, step.pad_token_id
    sampler = StepSampler.of(params, with_kept)
    draws = _Draws(m, device, params.greedy, seeds, generator)
    responses = torch.full((m, max_new), pad, dtype=torch.long, device=device)
    log_probs = torch.zeros((m, max_new), dtype=torch.float32, device=device)
    kept = torch.zeros((m, max_new), dtype=torch.long, device=device) if with_kept else None
    lengths = torch.full((m,), max_new, dtype=torch.long, device=device)
    alive = torch.ones(m, dtype=torch.bool, device=device)
    sampled = sampler(logits, draws.at(0))
    steps_run = 0
    for s in range(max_new):
        tokens = sampled[0]
        responses[:, s] = torch.where(alive, tokens, pad)
        log_probs[:, s] = torch.where(alive, sampled[1], 0.0)
        if kept is not None:
            kept[:, s] = torch.where(alive, sampled[2], 0)
        finished = torch.isin(tokens, eos_token_ids)
        if caps is not None:
            finished |= caps <= s + 1
        finished &= alive
        lengths.masked_fill_(finished, s + 1)
        alive &= ~finished
        if s + 1 == max_new:
            break
        if (s + 1) % CHECK_EVERY == 0:
            if not bool(alive.any()):
                break
            draws.check(s + 1)
        sampled = step.step(tokens.masked_fill(~alive, pad), draws.at(s + 1), sampler)
        steps_run += 1
    draws.settle(steps_run + 1, int(lengths.max()))
    return responses, log_probs, lengths, kept, steps_run
