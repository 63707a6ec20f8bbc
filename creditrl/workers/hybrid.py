"""One rank's colocated models (verl's "hybrid engine"): the actor, the rollout engine that
samples with the actor's weights, the reference and, when configured, the critic.

The same class serves the in-process backend (one rank, no process group) and every rank of
the Ray backend (a process group among the ranks; each gets its data-parallel shard of the
Batch). Methods take a Batch and return a Batch of the new fields only, or a metrics dict.

Weights the rollout uses: under ``ddp`` (and in one process) the HF engine samples with the
actor's own modules, so an update is visible at once; under ``fsdp2`` the actor's parameters
are sharded, so the engine holds a full copy that ``sync_rollout_weights`` refreshes from the
shards after each update (all ranks must generate the same number of forward passes
otherwise, which sampling cannot promise). A vLLM engine (``rollout.engine=vllm``) holds its
own weights on the GPU; they are pushed in place after every update, and the engine sleeps
outside rollouts.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from creditrl.batch import Batch
from creditrl.config import Config
from creditrl.models import (
    CriticModel,
    apply_lora,
    disabled_adapters,
    load_causal_lm,
    load_tokenizer,
    resolve_model_path,
)
from creditrl.rollout import build_rollout_engine
from creditrl.workers.actor import ActorWorker
from creditrl.workers.checkpoint_io import load_trainable, save_trainable
from creditrl.workers.critic import CriticWorker
from creditrl.workers.distributed import all_reduce_sum, rank, world_size
from creditrl.workers.parallel import full_state_dict, shard_model

__all__ = ["ADDITIVE_METRICS", "HybridWorker"]

# Update metrics that are sums over the samples of a mini-batch (losses divided by global
# counts, share-weighted fractions): summed over ranks. The rest (grad norm, lr) are equal
# on every rank.
ADDITIVE_METRICS = (
    "actor/pg_loss",
    "actor/entropy",
    "actor/kl_loss",
    "actor/pg_clipfrac",
    "actor/pg_clipfrac_lower",
    "actor/ppo_kl",
    "health/first_minibatch_ppo_kl",
    "health/first_minibatch_clipfrac",
    "critic/vf_loss",
    "critic/vf_clipfrac",
    "critic/vpred_mean",
)


def _optimizer_steps(cfg: Config, mini_batch_size: int, epochs: int) -> int:
    per_step = -(-cfg.data.train_batch_size // mini_batch_size)
    return cfg.trainer.total_steps * per_step * max(epochs, 1)


def _per_rank(cfg: Any, n: int, world: int, what: str) -> Any:
    """The section with ``ppo_mini_batch_size`` counted in trajectories per rank."""
    trajectories = cfg.ppo_mini_batch_size * n
    if trajectories % world:
        raise ValueError(
            f"{what}.ppo_mini_batch_size x rollout.n = {trajectories} trajectories must divide "
            f"evenly over trainer.workers={world}"
        )
    return dataclasses.replace(cfg, ppo_mini_batch_size=trajectories // world)


class HybridWorker:
    """Actor + rollout + reference (+ critic) of one data-parallel rank."""

    def __init__(self, cfg: Config, *, roles: tuple[str, ...] = ("actor", "critic")) -> None:
        self.cfg = cfg
        self.rank, self.world = rank(), world_size()
        torch.manual_seed(cfg.trainer.seed)
        self.model_path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
        self.tokenizer = load_tokenizer(self.model_path)
        self.use_ref = cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss
        self.n = cfg.rollout.n
        self.actor = self.ref = self.engine = self.rollout = self.critic = None
        if "actor" in roles:
            self._build_actor()
        if "critic" in roles and cfg.algorithm.adv_estimator == "gae":
            self._build_critic()

    # ---- construction -------------------------------------------------------------------

    def _actor_cfg(self, section: Any, what: str) -> tuple[Any, int]:
        """(config for this rank's worker, n_per_prompt to pass to its update)."""
        if self.world == 1:
            return section, self.n
        return _per_rank(section, self.n, self.world, what), 1

    def _shard(self, model: torch.nn.Module) -> None:
        trainer = self.cfg.trainer
        shard_model(
            model,
            trainer.strategy,
            cpu_offload=trainer.fsdp_cpu_offload,
            param_dtype=trainer.fsdp_param_dtype,
        )

    def _build_actor(self) -> None:
        cfg = self.cfg
        policy = load_causal_lm(self.model_path, cfg.model.dtype, cfg.model.gradient_checkpointing)
        ref_model = None
        if cfg.model.lora_rank > 0:
            policy = apply_lora(
                policy, cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.target_modules
            )
        elif self.use_ref:
            ref_model = copy.deepcopy(policy).eval().requires_grad_(False)
        sharded = self.world > 1 and cfg.trainer.strategy == "fsdp2"
        self.uses_vllm = cfg.rollout.engine == "vllm"
        if self.uses_vllm and cfg.model.lora_rank > 0:
            raise ValueError("rollout.engine=vllm with model.lora_rank > 0 is not supported yet")
        rollout_model = policy
        if sharded and not self.uses_vllm:
            rollout_model = copy.deepcopy(policy).eval().requires_grad_(False)
        self._shard(policy)
        actor_cfg, self.actor_n = self._actor_cfg(cfg.actor, "actor")
        self.actor = ActorWorker(
            policy,
            actor_cfg,
            total_optimizer_steps=_optimizer_steps(
                cfg, cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_epochs
            ),
            seed=cfg.trainer.seed + self.rank,
        )
        if ref_model is not None:
            self.ref = ActorWorker(ref_model, cfg.actor, trainable=False)
        llm_kwargs = {"distributed_executor_backend": "external_launcher"} if self.world > 1 else {}
        self.engine = build_rollout_engine(
            rollout_model,
            self.model_path,
            self.tokenizer,
            cfg.rollout,
            seed=cfg.trainer.seed + self.rank,
            llm_kwargs=llm_kwargs if self.uses_vllm else None,
        )
        self.rollout = self.engine  # what generate() calls: the engine, or the agent loop over it
        if self.uses_vllm:
            self.sync_rollout_weights()
        if cfg.agent.enable:
            from creditrl.agents.rollout import AgentRollout

            self.rollout = AgentRollout(self.engine, self.tokenizer, cfg.agent, cfg.rollout)

    def _build_critic(self) -> None:
        cfg = self.cfg
        path = resolve_model_path(cfg.model.critic_path or cfg.model.path, cfg.model.cache_dir)
        model = CriticModel.from_actor(path, cfg.model.dtype)
        self._shard(model)
        critic_cfg, self.critic_n = self._actor_cfg(cfg.critic, "critic")
        self.critic = CriticWorker(
            model,
            critic_cfg,
            total_optimizer_steps=_optimizer_steps(
                cfg, cfg.critic.ppo_mini_batch_size, cfg.critic.ppo_epochs
            ),
            micro_batch_size=cfg.actor.log_prob_micro_batch_size,
            seed=cfg.trainer.seed + self.rank,
        )

    # ---- the trainer's calls ------------------------------------------------------------

    def generate(
        self, prompts: Batch, greedy: bool = False, temperature: float | None = None
    ) -> Batch:
        """Sample one response per prompt row (see ``HFRolloutEngine.generate``); a vLLM engine
        wakes up for it and sleeps after, giving the GPU memory back to training."""
        if not self.uses_vllm:
            return self.rollout.generate(prompts, greedy=greedy, temperature=temperature)
        self.engine.wake_up()
        try:
            return self.rollout.generate(prompts, greedy=greedy, temperature=temperature)
        finally:
            self.engine.sleep()

    def compute_log_prob(self, batch: Batch, temperature: float) -> Batch:
        """``old_log_probs`` and ``entropys`` under the actor."""
        log_probs, entropy = self.actor.compute_log_prob(batch, temperature)
        return Batch.from_dict({"old_log_probs": log_probs, "entropys": entropy})

    def compute_ref_log_prob(self, batch: Batch, temperature: float) -> Batch:
        """``ref_log_prob``: the base model under LoRA (adapters off), else the frozen copy."""
        if self.cfg.model.lora_rank > 0:
            with disabled_adapters(self.actor.model):
                log_probs, _ = self.actor.compute_log_prob(batch, temperature, False)
        else:
            log_probs, _ = self.ref.compute_log_prob(batch, temperature, False)
        return Batch.from_dict({"ref_log_prob": log_probs})

    def compute_values(self, batch: Batch) -> Batch:
        """``values`` V(s_t) of the critic."""
        return Batch.from_dict({"values": self.critic.compute_values(batch)})

    def update_actor(self, batch: Batch, temperature: float) -> dict[str, float]:
        """PPO epochs on this rank's shard; gradients are summed over ranks."""
        metrics = self.actor.update_policy(batch, temperature, self.actor_n)
        self.sync_rollout_weights()
        return _reduce(metrics)

    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Value-loss epochs on this rank's shard."""
        return _reduce(self.critic.update_critic(batch, self.critic_n))

    def sync_rollout_weights(self) -> None:
        """Push the actor's weights to the rollout: nothing when the HF engine samples with the
        actor's own modules; a full copy gathered from the shards (fsdp2); or, for vLLM, the
        full state dict loaded in place (its KV cache stays asleep until the next rollout)."""
        if self.uses_vllm:
            self.engine.wake_up(tags=["weights"])
            self.engine.update_weights(full_state_dict(self.actor.model).items())
            return
        if self.engine.model is self.actor.model:
            return
        self.engine.model.load_state_dict(full_state_dict(self.actor.model))

    # ---- checkpoints --------------------------------------------------------------------

    def trainables(self) -> dict[str, tuple[Any, Any, Any]]:
        """Named (model, optimizer, scheduler) triples to checkpoint."""
        parts = {}
        if self.actor is not None:
            parts["actor"] = (self.actor.model, self.actor.optimizer, self.actor.scheduler)
        if self.critic is not None:
            parts["critic"] = (self.critic.model, self.critic.optimizer, self.critic.scheduler)
        return parts

    def generators(self) -> dict[str, torch.Generator]:
        """This rank's random streams (update shuffles, rollout fallback stream)."""
        gens = {}
        if self.actor is not None:
            gens.update(actor=self.actor.generator, rollout=self.engine.generator)
        if self.critic is not None:
            gens["critic"] = self.critic.generator
        return gens

    def save_checkpoint(self, directory: str) -> dict[str, Any]:
        """Write this rank's part of a checkpoint into ``directory`` (a collective)."""
        path = Path(directory)
        meta: dict[str, Any] = {
            name: save_trainable(path, name, *parts, fmt=self.cfg.trainer.checkpoint_format)
            for name, parts in self.trainables().items()
        }
        meta["world_size"] = self.world
        gens = {f"rank{self.rank}.{k}": g.get_state() for k, g in self.generators().items()}
        save_file(gens, str(path / f"generators.rank{self.rank}.safetensors"))
        return meta

    def load_checkpoint(self, directory: str, meta: dict[str, Any]) -> None:
        """Restore from ``directory`` for this world size (a collective). Random streams are
        restored when the checkpoint was written by as many ranks; else they restart from
        the seed (the data order is the controller's and does not change)."""
        path = Path(directory)
        for name, parts in self.trainables().items():
            load_trainable(path, name, meta[name], *parts)
        if self.actor is not None:
            self.sync_rollout_weights()
        file = path / f"generators.rank{self.rank}.safetensors"
        if file.is_file() and meta.get("world_size", self.world) == self.world:
            states = load_file(str(file))
            for key, gen in self.generators().items():
                if f"rank{self.rank}.{key}" in states:
                    gen.set_state(states[f"rank{self.rank}.{key}"])


def _reduce(metrics: dict[str, float]) -> dict[str, float]:
    summed = all_reduce_sum({k: v for k, v in metrics.items() if k in ADDITIVE_METRICS})
    return {**metrics, **summed}
