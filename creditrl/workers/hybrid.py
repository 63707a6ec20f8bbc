"""One rank's colocated models (verl's "hybrid engine"): the actor, the rollout engine that
samples with the actor's weights, the reference and, when the estimator requires values, the
critic. Or, with ``roles=("rollout",)``, a frozen policy and its engine only (the async
sampler's role), plus the reference with ``with_ref=True`` or a ``"ref"`` role.

The same class serves the in-process backend (one rank, no process group) and every rank of
the Ray backend (a process group among the ranks; each gets its data-parallel shard of the
Batch). Methods take a Batch and return a Batch of the new fields only, or a metrics dict.

Weights the rollout uses, from what the engine declares (``creditrl.rollout.RolloutEngine``):
an engine that ``samples_with_actor_module`` (``hf``) samples with the actor's own modules
under ``ddp`` and in one process, so an update is visible at once (a LoRA actor through the
merged copy the HF engine refreshes from it once per weight version,
``creditrl.rollout.merged_copy``); under ``fsdp2`` the actor's
parameters are sharded, so the engine holds a full copy that ``sync_rollout_weights``
refreshes from the shards after each update (all ranks must generate the same number of
forward passes otherwise, which sampling cannot promise). An engine with its own weights
(``vllm``) is pushed them at start and after every update, and is woken for each rollout and
put to sleep after it (no-ops for engines that never sleep).

The actor's weights reach its engine through the in-process weight channel ``weights``
(``creditrl.weights.InProcessChannel``, its push ``sync_rollout_weights``): every actor
update publishes a new version, and ``weights.version`` is the version the engine samples
with (the async learner's version is this one's).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Mapping
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
    load_reference,
    load_tokenizer,
    resolve_model_path,
)
from creditrl.rollout import EngineArgs, build_rollout_engine, check_rollout_engine, engine_traits
from creditrl.rollout.strategies import build_rollout
from creditrl.tracking.mfu import device_peak_flops, mfu_metrics, parameter_counts
from creditrl.weights import InProcessChannel
from creditrl.workers.actor import ActorWorker
from creditrl.workers.checkpoint_io import checkpoint_mismatch, load_trainable, save_trainable
from creditrl.workers.critic import CriticWorker
from creditrl.workers.device_memory import StageMemory
from creditrl.workers.distributed import all_reduce_sum, rank, world_size
from creditrl.workers.parallel import full_state_dict, shard_model
from creditrl.workers.placement import Placement, placement_for, to_cpu
from creditrl.workers.plan import Plan

__all__ = ["ADDITIVE_METRICS", "PREFILL_FIELD", "ROLES", "HybridWorker"]

# (B,) int64 field of generate()'s answer: the tokens this rank's rollout prefilled, on the
# rank's first row (0 on the others), so the sum over the concatenated ranks is the total.
PREFILL_FIELD = "rollout_prefill_tokens"

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


ROLES = ("actor", "critic", "rollout", "ref")


class HybridWorker:
    """Actor + rollout + reference (+ critic) of one data-parallel rank, or a rollout-only
    worker; see the module docstring.

    ``roles``: ``"actor"`` (the trainable policy with its rollout engine and, when a KL term
    needs it, the reference), ``"critic"`` (built when the estimator requires values),
    ``"rollout"`` (a frozen policy: no optimizer, eval mode, ``requires_grad`` off; LoRA
    adapters when ``model.lora_rank > 0`` and ``asynchronous.lora_sync=adapter``; its engine
    and the selected rollout strategy over it) and ``"ref"`` (the frozen reference, also asked
    for by ``with_ref=True``). ``"rollout"`` excludes ``"actor"``, which has its own engine.
    ``with_teacher``: build the distillation teacher when ``distill.teacher`` is set (None:
    with the ``"actor"`` role; an async sampler with ``distill.teacher_on=sampler`` asks for it,
    its learner goes without).
    """

    def __init__(
        self,
        cfg: Config,
        *,
        roles: tuple[str, ...] = ("actor", "critic"),
        with_ref: bool = False,
        with_teacher: bool | None = None,
    ) -> None:
        unknown = sorted(set(roles) - set(ROLES))
        if unknown:
            raise ValueError(f"unknown HybridWorker roles {unknown}; choose from {list(ROLES)}")
        if "actor" in roles and "rollout" in roles:
            raise ValueError("roles 'actor' and 'rollout' exclude each other: the actor samples")
        self.cfg = cfg
        self.rank, self.world = rank(), world_size()
        self.placement: Placement = placement_for(cfg)
        self.memory = StageMemory(self.placement.device)  # per-stage peaks; OOM as one line
        self.plan = Plan.from_config(cfg)
        if "actor" in roles or "rollout" in roles:
            check_rollout_engine(cfg.rollout.engine)  # before any model is built
        torch.manual_seed(cfg.trainer.seed)
        self.model_path = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
        self.tokenizer = load_tokenizer(self.model_path)
        self.use_ref = self.plan.needs_ref
        self.n = cfg.rollout.n
        self.actor = self.ref = self.engine = self.rollout = self.critic = None
        self.policy: torch.nn.Module | None = None  # the rollout role's frozen policy
        self.engine_shares_policy = False  # the engine samples with the policy module itself
        # the actor's weights to its engine, by version (the rollout role's policy is loaded by
        # its owner's channel: an async sampler's FolderChannel)
        self.weights: InProcessChannel | None = None
        if "actor" in roles:
            self._build_actor()
        if "rollout" in roles:
            self._build_rollout()
        if ("ref" in roles or with_ref) and self.ref is None:
            self.ref = self._frozen(load_reference(self.model_path, cfg.model.dtype))
        self.teacher: ActorWorker | None = None
        if with_teacher is None:
            with_teacher = "actor" in roles
        if with_teacher and self.plan.needs_teacher:
            self._build_teacher()
        if "critic" in roles and self.plan.needs_critic:
            self._build_critic()

    # ---- construction -------------------------------------------------------------------

    def _actor_cfg(self, section: Any, what: str) -> tuple[Any, int]:
        """(config for this rank's worker, n_per_prompt to pass to its update)."""
        if self.world == 1:
            return section, self.n
        return _per_rank(section, self.n, self.world, what), 1

    def _placed(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` moved to this rank's device (before sharding and before any optimizer)."""
        return model.to(self.placement.device)

    def _frozen(self, model: torch.nn.Module) -> ActorWorker:
        """A reference ``ActorWorker`` (no optimizer) over ``model`` on the device."""
        return ActorWorker(
            self._placed(model), self.cfg.actor, trainable=False, placement=self.placement
        )

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
        policy = self._placed(policy)
        ref_model = None
        lora = cfg.model.lora_rank > 0
        if lora:
            policy = apply_lora(
                policy, cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.target_modules
            )
        elif self.use_ref:
            ref_model = load_reference(self.model_path, cfg.model.dtype)
        sharded = self.world > 1 and cfg.trainer.strategy == "fsdp2"
        samples_with_module = engine_traits(cfg.rollout.engine).samples_with_actor_module
        rollout_model = policy
        if sharded and samples_with_module:
            rollout_model = copy.deepcopy(policy).eval().requires_grad_(False)
        self.engine_shares_policy = samples_with_module and not sharded
        self._shard(policy)
        actor_cfg, self.actor_n = self._actor_cfg(cfg.actor, "actor")
        self.actor = ActorWorker(
            policy,
            actor_cfg,
            total_optimizer_steps=_optimizer_steps(
                cfg, cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_epochs
            ),
            seed=cfg.trainer.seed + self.rank,
            placement=self.placement,
        )
        if ref_model is not None:
            self.ref = self._frozen(ref_model)
        self._build_engine(rollout_model, lora)
        self.weights = InProcessChannel(self.sync_rollout_weights)
        if not samples_with_module:
            self.weights.publish(policy, self.weights.version)

    def _build_teacher(self) -> None:
        """The distillation teacher, frozen and placed like the reference: ``distill.teacher=
        self`` shares the reference when there is one and, under LoRA, is the actor with its
        adapters off (``compute_teacher_log_prob``); else ``creditrl.pipeline.teacher``."""
        from creditrl.pipeline.teacher import load_teacher

        shares = self.ref is not None or (self.actor is not None and self.cfg.model.lora_rank > 0)
        if self.cfg.distill.teacher == "self" and shares:
            self.teacher = self.ref
            return
        student = self.actor.model if self.actor is not None else self.policy
        sampled = 0 if student is None else student.get_input_embeddings().num_embeddings
        self.teacher = self._frozen(load_teacher(self.cfg, max(sampled, len(self.tokenizer))))

    def _build_rollout(self) -> None:
        cfg = self.cfg
        policy = load_causal_lm(self.model_path, cfg.model.dtype).requires_grad_(False).eval()
        policy = self._placed(policy)
        lora = cfg.model.lora_rank > 0 and cfg.asynchronous.lora_sync == "adapter"
        if lora:
            policy = apply_lora(
                policy, cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.target_modules
            )
            policy = policy.requires_grad_(False).eval()
        self.policy = policy
        self.engine_shares_policy = engine_traits(cfg.rollout.engine).samples_with_actor_module
        self._build_engine(policy, lora)
        if not self.engine_shares_policy:
            self.sync_rollout_weights()

    def _build_engine(self, model: torch.nn.Module, lora: bool) -> None:
        """The engine ``rollout.engine`` names, and ``rollout``: what ``generate`` calls (the
        selected rollout strategy built around the engine: the engine itself, the agent loop
        or the agent program over it)."""
        cfg = self.cfg
        args = EngineArgs(
            cfg.rollout,
            self.tokenizer,
            self.model_path,
            model,
            seed=cfg.trainer.seed + self.rank,
            world_size=self.world,
            lora=lora,
        )
        self.engine = build_rollout_engine(args)
        self.rollout = build_rollout(self.engine, self.tokenizer, cfg)

    def _build_critic(self) -> None:
        cfg = self.cfg
        path = resolve_model_path(cfg.model.critic_path or cfg.model.path, cfg.model.cache_dir)
        critic = CriticModel.from_actor(path, cfg.model.dtype, autocast=self.placement.autocast)
        model = self._placed(critic)
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
        self,
        prompts: Batch,
        greedy: bool = False,
        temperature: float | None = None,
        seed: int | None = None,
    ) -> Batch:
        """Sample one response per prompt row (``creditrl.rollout.RolloutEngine.generate``;
        ``seed`` re-seeds the engine's generator first). The engine is woken for it and put
        to sleep after, giving its accelerator memory back to training (no-ops for engines
        that never sleep). When the rollout reports ``last_stats["prefill_tokens"]`` (the HF
        engine and the agent loop over it do), the answer carries it in ``PREFILL_FIELD``."""
        self.engine.wake_up()
        try:
            with self.memory.stage("gen"):
                out = self.rollout.generate(
                    prompts, greedy=greedy, temperature=temperature, seed=seed
                )
        finally:
            self.engine.sleep()
        out = to_cpu(out)  # the engine follows the model's device; the pipeline reads the CPU
        prefill = self.rollout.last_stats.get("prefill_tokens")  # declared by every rollout
        if prefill is not None and len(out):
            counts = torch.zeros(len(out), dtype=torch.long)
            counts[0] = int(prefill)
            out[PREFILL_FIELD] = counts
        return out

    def compute_log_prob(self, batch: Batch, temperature: float) -> Batch:
        """``old_log_probs`` and ``entropys`` under the actor."""
        with self.memory.stage("old_log_prob"):
            log_probs, entropy = self.actor.compute_log_prob(
                self.placement.to_device(batch), temperature
            )
        return to_cpu(Batch.from_dict({"old_log_probs": log_probs, "entropys": entropy}))

    def compute_ref_log_prob(self, batch: Batch, temperature: float) -> Batch:
        """``ref_log_prob``: the frozen reference, else (the actor under LoRA) the base model
        with the adapters off."""
        if self.ref is None and (self.actor is None or self.cfg.model.lora_rank == 0):
            raise RuntimeError(
                "this worker has no reference model: build it with HybridWorker(cfg, "
                "roles=('rollout', 'ref')) or with_ref=True"
            )
        return self._frozen_log_probs(self.ref, batch, temperature, "ref", "ref_log_prob")

    def compute_teacher_log_prob(self, batch: Batch, temperature: float) -> Batch:
        """``teacher_log_prob`` of ``batch``'s responses under the distillation teacher, on the
        rows ``creditrl.pipeline.stages.teacher_inputs`` built (the teacher's prompt, then the
        student's response ids)."""
        base = self.cfg.distill.teacher == "self" and self.cfg.model.lora_rank > 0
        if self.teacher is None and not base:
            raise RuntimeError("this worker has no distillation teacher (set distill.teacher)")
        return self._frozen_log_probs(
            self.teacher, batch, temperature, "teacher", "teacher_log_prob"
        )

    def _frozen_log_probs(
        self, model: Any, batch: Batch, temperature: float, stage: str, field: str
    ) -> Batch:
        """``field``: the responses' log-probs under the frozen ``model`` (None: the actor's
        base model, its LoRA adapters off), measured as memory stage ``stage``."""
        batch = self.placement.to_device(batch)
        with self.memory.stage(stage):
            if model is not None:
                log_probs, _ = model.compute_log_prob(batch, temperature, False)
            else:
                with disabled_adapters(self.actor.model):
                    log_probs, _ = self.actor.compute_log_prob(batch, temperature, False)
        return to_cpu(Batch.from_dict({field: log_probs}))

    def compute_values(self, batch: Batch) -> Batch:
        """``values`` V(s_t) of the critic."""
        with self.memory.stage("values"):
            values = self.critic.compute_values(self.placement.to_device(batch))
        return to_cpu(Batch.from_dict({"values": values}))

    def update_actor(self, batch: Batch, temperature: float) -> dict[str, float]:
        """PPO epochs on this rank's shard; gradients are summed over ranks. With the step's
        peak GPU memory per stage (``StageMemory.metrics``; none on the CPU) and the update's
        ``perf/mfu`` and ``perf/update_tokens_per_s`` on this rank (``tracking.mfu``)."""
        start = time.perf_counter()
        with self.memory.stage("update_actor"):
            metrics = self.actor.update_policy(
                self.placement.to_device(batch), temperature, self.actor_n
            )
        if self.placement.device.type == "cuda":  # the last optimizer step included
            torch.cuda.synchronize(self.placement.device)
        seconds = time.perf_counter() - start
        self.weights.publish(self.actor.model, self.weights.version + 1)
        tokens = int(batch["attention_mask"].sum()) * self.cfg.actor.ppo_epochs
        params, trained = parameter_counts(self.actor.model)
        peak = device_peak_flops(self.placement.device, self.cfg.trainer.device_peak_tflops)
        mfu = mfu_metrics(params, tokens, seconds, peak, trained)
        return {**_reduce(metrics), **self.memory.metrics(), **mfu}

    def update_critic(self, batch: Batch) -> dict[str, float]:
        """Value-loss epochs on this rank's shard, with the peak GPU memory so far this step."""
        with self.memory.stage("update_critic"):
            metrics = self.critic.update_critic(self.placement.to_device(batch), self.critic_n)
        return {**_reduce(metrics), **self.memory.metrics()}

    @property
    def policy_model(self) -> torch.nn.Module:
        """The policy module that weights are loaded into: the actor's, or the rollout role's
        frozen policy (for ``FolderChannel.load``; then ``sync_rollout_weights``)."""
        model = self.actor.model if self.actor is not None else self.policy
        if model is None:
            raise RuntimeError("this worker has no policy: build it with role 'actor' or 'rollout'")
        return model

    def load_policy_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load a full state dict into ``policy_model`` (strict; not a sharded actor) and push
        it to the engine unless the engine samples with that module."""
        self.policy_model.load_state_dict(state_dict)
        self.sync_rollout_weights()

    def sync_rollout_weights(self) -> None:
        """Push the policy's weights to the engine (the in-process channel's push): nothing
        when it samples with the policy's own module; else the full state dict (gathered from
        the shards under fsdp2) through ``update_weights``, with only the engine's weights
        awake (a sleeping engine's KV cache stays released until the next rollout)."""
        if self.engine_shares_policy:
            return
        self.engine.wake_up(tags=["weights"])
        self.engine.update_weights(full_state_dict(self.policy_model).items())

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
            gens["actor"] = self.actor.generator
        if self.engine is not None:
            gens["rollout"] = self.engine.generator
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

    def load_checkpoint(self, directory: str, meta: dict[str, Any]) -> str | None:
        """Restore from ``directory`` for this world size (a collective); None, or why the
        checkpoint does not fit these models (then nothing is loaded). Random streams are
        restored when the checkpoint was written by as many ranks on the same kind of device
        (a CUDA generator's state does not fit a CPU one); else they restart from the seed
        (the data order is the controller's and does not change)."""
        path = Path(directory)
        problem = checkpoint_mismatch(path, meta, self.trainables())
        if problem is not None:
            return problem
        for name, parts in self.trainables().items():
            load_trainable(path, name, meta[name], *parts)
        if self.actor is not None:
            self.weights.publish(self.actor.model, self.weights.version)
        file = path / f"generators.rank{self.rank}.safetensors"
        if file.is_file() and meta.get("world_size", self.world) == self.world:
            states = load_file(str(file))
            for key, gen in self.generators().items():
                state = states.get(f"rank{self.rank}.{key}")
                if state is not None and state.numel() == gen.get_state().numel():
                    gen.set_state(state)  # another device's stream (CPU vs CUDA) restarts
        return None


def _reduce(metrics: dict[str, float]) -> dict[str, float]:
    summed = all_reduce_sum({k: v for k, v in metrics.items() if k in ADDITIVE_METRICS})
    return {**metrics, **summed}
