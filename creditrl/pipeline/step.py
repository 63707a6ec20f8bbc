"""One step pipeline (spec 002), composed in one place and split in two halves.

``generation_half``: generate (engine or agent loop) -> greedy baseline when the estimator
requires ``reward_baselines`` -> reward. ``training_half``: old log-probs -> reference
log-probs -> the distillation teacher's log-probs (``distill.teacher``) -> values (when the
estimator requires them) -> KL and distillation into rewards -> overlong shaping -> mismatch
metrics -> rollout importance weights -> advantages -> critic update -> actor update. The
synchronous trainer runs both; the async sampler runs the first (plus the reference when it
computes it) and the learner the second: the same functions, not copies.

The model calls go through a worker group (``creditrl.controller``: in process or on Ray), so
the pipeline cannot tell where the models live.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from creditrl.batch import Batch
from creditrl.config import AlgorithmConfig, Config
from creditrl.config.agent_task import is_agent_task
from creditrl.core import get_kl_controller
from creditrl.data import collate_prompts
from creditrl.pipeline import stages
from creditrl.rollout import rollout_log_probs_are_actors
from creditrl.rollout.strategies import strategy_datasets
from creditrl.tracking import Timer
from creditrl.workers.hybrid import PREFILL_FIELD
from creditrl.workers.placement import placement_for, update_autocast
from creditrl.workers.plan import Plan, structured_reward

__all__ = [
    "StepPipeline",
    "build_reward_manager",
    "build_run_datasets",
    "rollout_log_probs_are_actors",
    "rollout_log_probs_reusable",
    "sampled_temperature",
]

log = logging.getLogger(__name__)


def sampled_temperature(batch: Batch, cfg: Config) -> float:
    """The temperature ``batch`` was sampled at (``meta["temperature"]``, written by
    ``StepPipeline.generate``), which every log-prob pass and the update divide the logits by;
    ``rollout.temperature`` for a batch that does not say."""
    return float(batch.meta.get("temperature", cfg.rollout.temperature))


def build_run_datasets(cfg: Config, tokenizer: Any) -> tuple[Any, Any]:
    """(train, validation) datasets of ``cfg``: the selected rollout strategy's own (an
    environment hub's), an agent task's, or the data section's."""
    from creditrl.agents.tasks import build_agent_datasets
    from creditrl.data import build_datasets

    own = strategy_datasets(cfg, tokenizer)
    if own is not None:
        return own
    if is_agent_task(cfg.data):
        return build_agent_datasets(cfg, tokenizer)
    return build_datasets(cfg.data, tokenizer, cfg.distill)


def build_reward_manager(cfg: Config, tokenizer: Any) -> Any:
    """The reward manager of ``cfg``: spec 001's structured manager for agent runs that ask for
    it, else the rule scorers (and reward model) chosen by ``data_source``."""
    if structured_reward(cfg):
        from creditrl.agents.rewards import StructuredRewardManager

        return StructuredRewardManager(cfg.reward, cfg.agent, tokenizer)
    from creditrl.rewards import RewardManager

    reward_model = None
    if cfg.reward.reward_model.enable:  # on this process's device (CPU beside Ray workers)
        from creditrl.rewards.reward_model import RewardModelWorker

        device = placement_for(cfg).device if cfg.trainer.backend == "local" else "cpu"
        reward_model = RewardModelWorker(cfg.reward.reward_model, tokenizer, device)
    return RewardManager(cfg.reward, tokenizer, reward_model)


def rollout_log_probs_reusable(cfg: Config) -> bool:
    """The rollout's log-probs can stand for ``old_log_probs``: the engine samples from exactly
    the actor's distribution (``creditrl.rollout.rollout_log_probs_are_actors``), the update
    runs in the engine's float32 (under bf16 autocast the update's log-probs differ from the
    engine's by ~0.03 a token, so reused ones would start the ratio away from 1 and clip ~10%
    of tokens at the first mini-batch; they are recomputed under the update's precision), and
    rollout IS is off (it compares recomputed log-probs with the sampler's; with reused ones
    its weights would be exactly 1, a silent no-op). A LoRA actor is sampled from its merged
    copy (``creditrl.rollout.merged_copy``), whose float32 log-probs equal the adapter model's
    to rounding, the size of the gap the engine's KV-cache decode already has for a full model
    (``tests/test_lora_sampling.py``), so they are reused alike."""
    return (
        cfg.actor.use_rollout_log_probs
        and not cfg.algorithm.rollout_is.enable
        and update_autocast(cfg) == "none"
        and rollout_log_probs_are_actors(cfg)
    )


@dataclass
class StepPipeline:
    """The stages of a step over ``workers`` (a worker group) and ``reward`` (a reward
    manager), as ``cfg`` and its ``plan`` ask. ``algorithm`` defaults to ``cfg.algorithm`` (the
    learner turns rollout IS on for stale rows)."""

    cfg: Config
    workers: Any
    reward: Any
    tokenizer: Any
    algorithm: AlgorithmConfig | None = None
    plan: Plan = field(init=False)
    kl_ctrl: Any = field(init=False)
    prefill: tuple[int | None, int | None] = field(init=False, default=(None, None))

    def __post_init__(self) -> None:
        self.plan = Plan.from_config(self.cfg)
        self.algorithm = self.algorithm or self.cfg.algorithm
        kl = self.algorithm.kl_ctrl
        self.kl_ctrl = get_kl_controller(kl.type, kl.kl_coef, kl.target_kl, kl.horizon)

    # ---- generation half -----------------------------------------------------------------

    def _rollout(self, prompts: Batch, **kwargs: Any) -> tuple[Batch, int | None]:
        """The workers' responses and the tokens they prefilled (None: not reported)."""
        batch = self.workers.generate(prompts, **kwargs)
        if PREFILL_FIELD not in batch:
            return batch, None
        counts = batch[PREFILL_FIELD]
        del batch[PREFILL_FIELD]
        return batch, int(counts.sum())

    def generate(self, prompts: Batch, step: int, **kwargs: Any) -> Batch:
        """Responses (ids, masks, rollout log-probs) to ``prompts``; ``meta`` says how.
        ``prefill`` = (step, tokens prefilled by this step's generate calls so far)."""
        batch, tokens = self._rollout(prompts, **kwargs)
        last_step, total = self.prefill
        if tokens is not None:
            tokens += total if last_step == step and total is not None else 0
        self.prefill = (step, tokens)
        batch.meta.update(
            temperature=kwargs.get("temperature") or self.cfg.rollout.temperature,
            max_response_length=self.cfg.rollout.max_response_length,
            eos_token_id=self.tokenizer.eos_token_id,
            step=step,
        )
        return batch

    def generation_half(
        self, prompts: Batch, step: int, timing: dict[str, float], **kwargs: Any
    ) -> tuple[Batch, Any]:
        """generate -> (greedy baseline) -> submit for scoring. Returns the batch and the
        reward future; ``score`` writes its result when it is wanted."""
        with Timer("gen", timing):
            batch = self.generate(prompts, step, **kwargs)
        if self.plan.needs_greedy_baseline:
            with Timer("gen_greedy", timing):
                greedy, _ = self._rollout(prompts, greedy=True)
                batch["reward_baselines"] = self.reward(greedy).scores.float()
        return batch, self.reward.submit(batch)

    def score(
        self, batch: Batch, future: Any, timing: dict[str, float], name: str
    ) -> dict[str, float]:
        """Wait for the reward and write ``token_level_scores`` (and extras) into ``batch``.
        Returns the reward's metrics and ``rollout/prefill_tokens``: the token positions
        (padding not counted) pushed through prefill forwards by the generate calls of the
        batch's step (every generation batch of it; greedy baselines and validation not
        counted), when the rollout reports them."""
        with Timer(name, timing):
            result = future.result()
        result.write_to(batch)
        metrics = dict(result.metrics)
        step, tokens = self.prefill
        if tokens is not None and step == batch.meta.get("step"):
            metrics["rollout/prefill_tokens"] = float(tokens)
        return metrics

    # ---- training half -------------------------------------------------------------------

    def old_log_probs(self, batch: Batch, keep_rollout: torch.Tensor | bool) -> Batch:
        """``old_log_probs``: the rollout's where ``keep_rollout`` is True (rows the sampler
        provably sampled from the actor's own distribution), recomputed by the actor elsewhere
        (with ``entropys`` when every row is recomputed)."""
        keep = torch.as_tensor(keep_rollout).expand(len(batch)) if len(batch) else None
        if keep is not None and bool(keep.all()):
            batch["old_log_probs"] = batch["rollout_log_probs"].clone()
            return batch
        if keep is None or not bool(keep.any()):
            new = self.workers.compute_log_prob(batch, sampled_temperature(batch, self.cfg))
            return batch.union(new)
        rows = (~keep).nonzero().flatten()
        new = self.workers.compute_log_prob(batch[rows], sampled_temperature(batch, self.cfg))
        old = batch["rollout_log_probs"].clone()
        old[rows] = new["old_log_probs"].to(old.dtype)
        batch["old_log_probs"] = old
        return batch

    def training_half(
        self,
        batch: Batch,
        timing: dict[str, float],
        *,
        keep_rollout: torch.Tensor | bool,
        update_actor: bool = True,
    ) -> tuple[Batch, dict[str, float]]:
        """old/ref log-probs, values, rewards, weights, advantages, critic and actor updates."""
        cfg, plan, metrics = self.cfg, self.plan, {}
        if "old_log_probs" not in batch:
            with Timer("old_log_prob", timing):
                batch = self.old_log_probs(batch, keep_rollout)
        if plan.needs_ref and "ref_log_prob" not in batch:
            with Timer("ref", timing):
                batch = batch.union(
                    self.workers.compute_ref_log_prob(batch, sampled_temperature(batch, cfg))
                )
        if plan.needs_teacher and "teacher_log_prob" not in batch:
            with Timer("teacher", timing):
                batch, rejected = self.teacher_log_probs(batch)
            metrics["distill/rejected_teacher_prompts"] = float(rejected)
        if plan.needs_critic:
            with Timer("values", timing):
                batch = batch.union(self.workers.compute_values(batch))
        with Timer("adv", timing):
            metrics.update(self.advantages(batch))
        if plan.needs_critic:
            with Timer("update_critic", timing):
                metrics.update(self.workers.update_critic(batch))
        if update_actor:
            with Timer("update_actor", timing):
                metrics.update(self.workers.update_actor(batch, sampled_temperature(batch, cfg)))
        return batch, metrics

    def teacher_log_probs(self, batch: Batch) -> tuple[Batch, int]:
        """``teacher_log_prob`` of the sampled tokens under the distillation teacher, on its
        prompt followed by the student's response ids (``stages.teacher_inputs``), and how
        many rows' ``teacher_prompt_ids`` were refused (logged; their teacher log-probs are
        the old ones, so they carry no distillation term; on an async sampler, which has no
        old ones, the behaviour policy's)."""
        rows, rejected = stages.teacher_inputs(
            batch,
            self.tokenizer.pad_token_id,
            len(self.tokenizer),
            self.cfg.data.max_prompt_length,
        )
        teacher = self.workers.compute_teacher_log_prob(rows, sampled_temperature(batch, self.cfg))
        batch["teacher_log_prob"] = teacher["teacher_log_prob"]
        count = int(rejected.sum())
        if count:
            log.warning(
                "%d row(s) hold teacher_prompt_ids that are not 1..%d token ids below %d: "
                "trained without a distillation term",
                count,
                self.cfg.data.max_prompt_length,
                len(self.tokenizer),
            )
            own = "old_log_probs" if "old_log_probs" in batch else "rollout_log_probs"
            batch["teacher_log_prob"][rejected] = batch[own][rejected]
        return batch, count

    def advantages(self, batch: Batch) -> dict[str, float]:
        """KL (and distillation) into rewards -> overlong shaping -> mismatch metrics -> rollout
        IS -> advantages (the model-free block; ``kl_ctrl`` moves with the measured KL);
        score-only rows (agent episodes with no model turn) are neutral in the first four and
        masked out after."""
        alg = self.algorithm
        stages.neutral_score_only_rows(batch)
        metrics = stages.kl_into_rewards(batch, alg, self.kl_ctrl.value)
        if "actor/reward_kl_penalty" in metrics:
            self.kl_ctrl.update(metrics["actor/reward_kl_penalty"], len(batch))
        if "teacher_log_prob" in batch:
            metrics.update(stages.distill_into_rewards(batch, self.cfg.distill))
        metrics.update(
            stages.apply_overlong_penalty(batch, alg, self.cfg.rollout.max_response_length)
        )
        metrics.update(stages.rollout_mismatch_metrics(batch))
        metrics.update(stages.rollout_is_weights(batch, alg))
        stages.compute_advantages(batch, alg)
        stages.mask_score_only_rows(batch)
        return metrics

    # ---- validation ----------------------------------------------------------------------

    def validate(self, rows: Sequence[Any]) -> dict[str, float]:
        """Greedy (or ``val_temperature``) responses to ``rows``: val/score, val/<source>/score
        (mean@1), val/<source>/pass@k when ``val_n`` > 1, and val/<source>/strict_accuracy
        when the scorer reports ``answer_score`` and ``format_score`` (tagged and correct);
        val/agent/* the reward's per-sample agent metrics (e.g. agent/tool_then_correct)
        averaged over the validation samples, and val/agent/episodes_<status> the agent
        program's episodes counted by how they ended."""
        if not rows:
            return {}
        cfg = self.cfg.rollout
        chunk_size = max(cfg.micro_batch_size // max(cfg.val_n, 1), 1)
        scores: dict[str, list[float]] = {}
        strict: dict[str, list[float]] = {}
        agent: dict[str, float] = {}  # agent/* reward metrics x samples, summed over chunks
        episodes: Counter[str] = Counter()
        for start in range(0, len(rows), chunk_size):
            prompts = collate_prompts(
                list(rows[start : start + chunk_size]), self.tokenizer.pad_token_id
            ).repeat(cfg.val_n)
            batch, _ = self._rollout(
                prompts, greedy=cfg.val_temperature == 0, temperature=cfg.val_temperature or None
            )
            result = self.reward(batch)
            episodes.update(
                str(info["episode"])
                for info in batch.get("agent_info", ())
                if isinstance(info, dict) and "episode" in info
            )
            for key, value in getattr(result, "metrics", {}).items():
                if key.startswith("agent/"):
                    agent[key] = agent.get(key, 0.0) + value * len(batch)
            sources = list(batch["data_source"])
            for i, score in enumerate(result.scores.tolist()):
                scores.setdefault(sources[i], []).append(score)
            extra = getattr(result, "extra", {})
            answer, fmt = extra.get("answer_score"), extra.get("format_score")
            if answer is not None and fmt is not None:
                for i, (a, f) in enumerate(zip(answer, fmt, strict=True)):
                    ok = a is not None and f is not None and float(a) >= 1.0 and float(f) >= 1.0
                    strict.setdefault(sources[i], []).append(float(ok))
        out = {"val/score": float(np.mean([v for vs in scores.values() for v in vs]))}
        for source, values in scores.items():
            arr = np.array(values).reshape(-1, cfg.val_n)
            out[f"val/{source}/score"] = float(arr.mean())
            if cfg.val_n > 1:
                out[f"val/{source}/pass@{cfg.val_n}"] = float((arr.max(axis=1) > 0.5).mean())
        for source, values in strict.items():
            out[f"val/{source}/strict_accuracy"] = float(np.mean(values))
        if strict:
            out["val/strict_accuracy"] = float(np.mean([v for vs in strict.values() for v in vs]))
        total = sum(len(vs) for vs in scores.values())
        out.update({f"val/{key}": value / total for key, value in agent.items()})
        out.update({f"val/agent/episodes_{k}": float(n) for k, n in sorted(episodes.items())})
        return out
