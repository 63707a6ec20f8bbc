"""The GPU rollout engine: vLLM behind the ``RolloutEngine`` interface (``rollout.engine=vllm``).

Checked against vLLM's V1 engine, 0.10.2 (the oldest release with the log-probs it needs) up
to the 2026 main branch (see ``docs/vllm.md`` for the files read); it has never run on a GPU.

Token ids in, token ids out: each prompt row's real ids (left padding stripped with its
``attention_mask``) go to vLLM as ``{"prompt_token_ids": ids}`` (vLLM's ``TokensPrompt``), and
the ids vLLM samples come back as they are; nothing is decoded or re-encoded
(``detokenize=False``). The returned Batch has exactly the fields ``HFRolloutEngine`` writes,
so every later stage is unchanged.

``rollout_log_probs[:, j]`` is log pi_sample(y_{j+1} | s_{j+1}), the sampled token's log-prob
under the sampling distribution, the same definition as ``creditrl.rollout.sampling``: the
logits divided by the temperature, then top-k / top-p filtered and renormalised (greedy:
``log_softmax`` of the unscaled logits). vLLM's default ``logprobs_mode="raw_logprobs"``
returns log-probs of the raw logits, *before* temperature and top-k/top-p, which differ from
the trainer's temperature-scaled log-probs whenever the temperature is not 1; this engine builds
``LLM(logprobs_mode="processed_logprobs")``, whose log-probs are taken after every logits
processor including temperature and top-k/top-p (vLLM PR #22387, in 0.10.2 and later;
``vllm/v1/sample/sampler.py``: greedy requests get ``log_softmax`` of the unscaled logits), and
asks for ``SamplingParams(logprobs=0)``: the sampled token only. Processed log-probs also keep
FlashInfer's sampler out (``vllm/v1/sample/ops/topk_topp_sampler.py``), as do per-request
seeds. vLLM's PyTorch top-k/top-p (``apply_top_k_top_p_pytorch``) keeps ties with the k-th
logit and drops a token when the mass of the more likely ones reaches p, as the HF engine
does; recent releases run a Triton kernel for it instead, whose tie handling is not checked.

Reproducibility: each trajectory is its own vLLM request with ``SamplingParams(seed=...)``,
taken from the batch's ``sample_seed`` (B,) int64 field when present (mod 2^63), else drawn
from the engine's ``generator`` (CPU ``torch.Generator``, seeded by ``seed``). vLLM gives a
seeded request its own random generator, so its samples do not depend on which other requests
share the batch (up to float rounding of batch-size dependent kernels). The same seed does
not give the same tokens as the HF engine: the two draw their randomness differently.

Weights: in V1 the model lives in vLLM's worker, so the old
``llm.llm_engine.model_executor.driver_worker...`` path is not used. Colocated with the
trainer on one GPU, ``update_weights(model.named_parameters())`` loads the trainer's tensors in
place through ``LLM.collective_rpc`` into ``WeightLoaderExtension`` (vLLM's
``worker_extension_cls``), i.e. the model's own ``load_weights`` (which fuses q/k/v and
gate/up, skips a tied ``lm_head`` and casts to the engine dtype), then resets the prefix cache
(``LLM.reset_prefix_cache``). This needs the engine core and its worker in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0`` with ``tensor_parallel_size=1`` and vLLM's in-process
executor, or ``distributed_executor_backend="external_launcher"`` on every rank of a
torch.distributed job, each rank its own engine), so the tensors pass by reference: nothing
is serialised. Loading straight into the live parameters is right for unquantised models whose
post-load processing leaves the weights as the checkpoint has them (vLLM's
``WeightTransferConfig(reload_mode="direct")`` makes the same assumption); quantised or
repacked weights need vLLM's own weight-transfer engines. ``sleep()`` / ``wake_up()`` free and
restore vLLM's GPU memory (weights and KV cache) between rollout phases
(``enable_sleep_mode``); after ``sleep(level=2)`` the weights are gone and must be pushed again
before sampling (vLLM issue #29341).

``llm_engine_kwargs`` and the request building and response assembly of
``creditrl.rollout.vllm_requests`` (``prompt_token_lists``, ``request_seeds``,
``sampling_param_dicts``; ``completions_from_outputs``, ``assemble_rollout``) are plain
functions that need neither vLLM nor a GPU.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedTokenizerBase

from creditrl.batch import Batch
from creditrl.config.schema import RolloutConfig
from creditrl.errors import ConfigError
from creditrl.rollout.engine import EngineArgs, RolloutEngine
from creditrl.rollout.registries import vllm_unavailable_reason
from creditrl.rollout.sampling import check_sampling_config, eos_token_ids_of, sampling_params_of
from creditrl.rollout.vllm_requests import (
    LOGPROBS_MODE,
    MAX_TEMPERATURE,
    VLLM_SAMPLING_EPS,
    assemble_rollout,
    completions_from_outputs,
    prompt_token_lists,
    request_seeds,
    sampling_param_dicts,
)

__all__ = [
    "LOGPROBS_MODE",
    "MAX_TEMPERATURE",
    "VLLM_SAMPLING_EPS",
    "WORKER_EXTENSION",
    "VLLMRolloutEngine",
    "WeightLoaderExtension",
    "assemble_rollout",
    "completions_from_outputs",
    "engine_core_in_process",
    "eos_token_ids_from_dir",
    "external_launcher_env",
    "llm_engine_kwargs",
    "prompt_token_lists",
    "request_seeds",
    "sampling_param_dicts",
    "vllm_unavailable_reason",
]

WORKER_EXTENSION = "creditrl.rollout.vllm_engine.WeightLoaderExtension"
EXTERNAL_LAUNCHER = "external_launcher"
# Executors that run the worker in the engine core's process (vllm/v1/executor/): ``uni``,
# vLLM's choice for one GPU when none is named, and ``external_launcher`` (one worker per rank).
_IN_PROCESS_BACKENDS = (None, "uni", EXTERNAL_LAUNCHER)
_DEFAULT_CHUNK_BYTES = 1 << 29  # 512 MiB of tensors per collective_rpc call


# ---- engine construction (pure) ------------------------------------------------------------


def engine_core_in_process(
    in_process: bool, tensor_parallel_size: int, distributed_executor_backend: str | None
) -> bool:
    """Whether vLLM's engine core and its only local worker run in this process, so that
    ``collective_rpc`` hands tensors over by reference (in-place ``update_weights``).

    ``external_launcher`` always runs in-process (one worker per rank; vLLM asserts
    ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, vllm/v1/executor/uniproc_executor.py). Otherwise it
    needs ``in_process`` (which sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, vLLM's
    ``InprocClient``), one GPU and the uni-process executor: ``mp`` or ``ray`` put the worker in
    another process even with one GPU."""
    if distributed_executor_backend == EXTERNAL_LAUNCHER:
        return True
    return (
        in_process
        and tensor_parallel_size == 1
        and distributed_executor_backend in _IN_PROCESS_BACKENDS
    )


def external_launcher_env(rank: int, world_size: int, local_rank: int) -> dict[str, str]:
    """The variables vLLM's ``external_launcher`` executor reads (``env://``:
    ``os.environ["RANK"]`` and ``["LOCAL_RANK"]``, vllm/v1/executor/uniproc_executor.py
    ``ExecutorWithExternalLauncher._distributed_args``) for a rank of a torch.distributed job
    that was not started by torchrun. ``local_rank`` is the CUDA device index vLLM will use
    (``cuda:{LOCAL_RANK}``): the trainer's current device."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    if local_rank < 0:
        raise ValueError(f"local_rank must be >= 0, got {local_rank}")
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size)}


def llm_engine_kwargs(
    model_path: str | Path,
    *,
    seed: int,
    gpu_memory_utilization: float,
    enable_sleep_mode: bool,
    dtype: str,
    tensor_parallel_size: int,
    max_model_len: int | None,
    enforce_eager: bool,
    extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` (all of them ``EngineArgs`` fields in
    vllm/engine/arg_utils.py, 0.10.2 to 2026 main).

    Fixed here: ``logprobs_mode="processed_logprobs"`` (the sampled token's log-prob after
    temperature and top-k/top-p, ``ModelConfig.logprobs_mode``), ``generation_config="vllm"``
    (vLLM's own defaults, not the model's generation_config.json sampling defaults) and
    ``worker_extension_cls`` (``WeightLoaderExtension``, for ``update_weights``). ``extra``
    (e.g. ``distributed_executor_backend``) is added as given; it may not override them."""
    kwargs: dict[str, Any] = {
        "model": str(model_path),
        "dtype": dtype,
        "seed": int(seed),
        "gpu_memory_utilization": float(gpu_memory_utilization),
        "enable_sleep_mode": bool(enable_sleep_mode),
        "tensor_parallel_size": int(tensor_parallel_size),
        "max_model_len": max_model_len,
        "enforce_eager": bool(enforce_eager),
        "logprobs_mode": LOGPROBS_MODE,
        "generation_config": "vllm",
        "worker_extension_cls": WORKER_EXTENSION,
    }
    clash = sorted(set(extra or {}) & set(kwargs))
    if clash:
        raise ValueError(
            f"llm_kwargs {clash} are set by VLLMRolloutEngine itself: pass them as its own "
            "arguments (logprobs_mode, generation_config and worker_extension_cls are fixed)"
        )
    kwargs.update(extra or {})
    return kwargs


def eos_token_ids_from_dir(model_path: str | Path, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """``eos_token_ids_of`` for a model directory: the tokenizer's EOS plus the EOS ids of its
    ``generation_config.json`` (if any), the same stop ids the HF engine uses."""
    try:
        generation_config = GenerationConfig.from_pretrained(str(model_path), local_files_only=True)
    except OSError:
        generation_config = None
    return eos_token_ids_of(SimpleNamespace(generation_config=generation_config), tokenizer)


# ---- the engine ----------------------------------------------------------------------------


class WeightLoaderExtension:
    """Methods vLLM mixes into its GPU worker (``LLM(worker_extension_cls=WORKER_EXTENSION)``:
    vllm/v1/worker/worker_base.py adds the class to the worker's bases, asserting that no name
    clashes with the worker's own, e.g. its ``update_weights``), called on every local worker by
    ``LLM.collective_rpc(name, args=...)``."""

    def creditrl_load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """Load Hugging Face-named tensors into the worker's model in place (the model's own
        ``load_weights``: fused projections, tied embeddings, dtype cast); returns their count.
        The model is ``model_runner.get_model()``, which unwraps vLLM's CUDA-graph wrapper
        (vllm/v1/worker/gpu_model_runner.py); ``model_runner.model`` where there is none."""
        runner = self.model_runner  # type: ignore[attr-defined]
        model = runner.get_model() if hasattr(runner, "get_model") else runner.model
        model.load_weights(weights)
        return len(weights)


def _export_external_launcher_env() -> None:
    """Set ``RANK`` / ``LOCAL_RANK`` / ``WORLD_SIZE`` (``external_launcher_env``) from the
    trainer's torch.distributed group when its launcher did not (creditrl's workers join the
    group through a TCP store, not torchrun). Nothing without a process group."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    device = torch.cuda.current_device() if torch.cuda.is_available() else 0
    wanted = external_launcher_env(dist.get_rank(), dist.get_world_size(), device)
    for key, value in wanted.items():
        os.environ.setdefault(key, value)
    if os.environ["RANK"] != wanted["RANK"]:
        raise RuntimeError(
            f"RANK={os.environ['RANK']} in the environment but this process is rank "
            f"{wanted['RANK']} of the torch.distributed group vLLM's external_launcher joins"
        )


def _weight_chunks(
    named_tensors: Iterable[tuple[str, torch.Tensor]], chunk_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    chunk: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"weight {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
        if type(tensor).__name__ == "DTensor":
            raise TypeError(
                f"weight {name!r} is a sharded DTensor: pass full tensors "
                "(creditrl.workers.parallel.full_state_dict)"
            )
        chunk.append((name, tensor.detach()))
        size += tensor.numel() * tensor.element_size()
        if size >= chunk_bytes:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


class VLLMRolloutEngine(RolloutEngine):
    """Samples responses for a prompt Batch with vLLM, registered as ``rollout.engine=vllm``.
    It holds its own weights (pushed with ``update_weights``), and its log-probs come from
    other kernels and dtype than the trainer's (not ``exact_log_probs``).

    ``model_path``: a local Hugging Face directory (``creditrl.models.resolve_model_path``).
    ``gpu_memory_utilization``: the share of the GPU vLLM may take for weights and KV cache
    (leave the rest to the trainer when colocated). ``enable_sleep_mode``: allow ``sleep()``.
    ``dtype``: vLLM's model dtype. ``eos_token_ids`` overrides the stop ids (default:
    ``eos_token_ids_from_dir``). ``in_process`` runs vLLM's engine core in this process
    (sets ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` for the process), which in-place
    ``update_weights`` needs. ``llm_kwargs`` go to ``vllm.LLM`` as they are. ``llm`` and
    ``sampling_params_cls`` replace ``vllm.LLM`` / ``vllm.SamplingParams`` (tests).

    ``last_stats`` describes the latest generate(): ``decode_s`` (wall seconds of vLLM's
    generate, prefill included: vLLM interleaves the two), ``prompt_tokens``, ``requests`` and
    ``response_tokens`` (valid tokens generated).
    """

    samples_with_actor_module = False
    exact_log_probs = False
    # vLLM returns the sampled token's log-prob, not the size of the set its top-k/top-p/min-p
    # kept: with truncation on, rollout.sampling_replay=true is refused in one line
    # (engine.check_sampling_replay); docs/sampling.md
    records_kept_set = False
    supports_lora = False  # LoRA weights would have to be merged or loaded as adapters
    options = ("gpu_memory_utilization", "enable_sleep_mode", "vllm_dtype", "tensor_parallel_size")

    def __init__(
        self,
        model_path: str | Path,
        tokenizer: PreTrainedTokenizerBase,
        cfg: RolloutConfig,
        *,
        seed: int = 0,
        gpu_memory_utilization: float = 0.5,
        enable_sleep_mode: bool = True,
        dtype: str = "bfloat16",
        tensor_parallel_size: int = 1,
        eos_token_ids: Sequence[int] | None = None,
        max_model_len: int | None = None,
        enforce_eager: bool = False,
        in_process: bool = True,
        llm_kwargs: Mapping[str, Any] | None = None,
        llm: Any = None,
        sampling_params_cls: Callable[..., Any] | None = None,
    ) -> None:
        check_sampling_config(cfg)
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"rollout.gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}"
            )
        if tensor_parallel_size < 1:
            raise ValueError(
                f"rollout.tensor_parallel_size must be >= 1, got {tensor_parallel_size}"
            )
        self.model_path = str(model_path)
        self.tokenizer = tokenizer
        self.cfg = cfg
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else tokenizer.eos_token_id)
        if eos_token_ids is None:
            eos_token_ids = eos_token_ids_from_dir(model_path, tokenizer)
        self.eos_token_ids: list[int] = [int(t) for t in eos_token_ids]
        self.generator = torch.Generator().manual_seed(seed)
        self.enable_sleep_mode = enable_sleep_mode
        backend = (llm_kwargs or {}).get("distributed_executor_backend")
        self.in_process = engine_core_in_process(in_process, tensor_parallel_size, backend)
        self.llm_kwargs = llm_engine_kwargs(
            self.model_path,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=enable_sleep_mode,
            dtype=dtype,
            tensor_parallel_size=tensor_parallel_size,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            extra=llm_kwargs,
        )
        self.asleep: set[str] = set()  # memory tags vLLM has released ("weights", "kv_cache")
        self.weights_discarded = False  # sleep(level=2) dropped them; update_weights restores
        self.last_stats: dict[str, float] = {}
        if llm is None:
            reason = vllm_unavailable_reason()
            if reason is not None:
                raise RuntimeError(f"rollout.engine=vllm: {reason}")
            if in_process or backend == EXTERNAL_LAUNCHER:
                # read when the engine is built: vLLM's InprocClient instead of a separate
                # engine-core process (vllm/v1/engine/core_client.py); external_launcher
                # asserts it
                os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            if backend == EXTERNAL_LAUNCHER:
                _export_external_launcher_env()
            import vllm

            llm = vllm.LLM(**self.llm_kwargs)
            sampling_params_cls = sampling_params_cls or vllm.SamplingParams
        if sampling_params_cls is None:
            raise ValueError("pass sampling_params_cls together with llm")
        self.llm = llm
        self.sampling_params_cls = sampling_params_cls

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """``vllm_unavailable_reason`` with what to use instead."""
        reason = vllm_unavailable_reason()
        return None if reason is None else f"{reason}. On CPU use rollout.engine=hf."

    @classmethod
    def from_args(cls, args: EngineArgs) -> VLLMRolloutEngine:
        """The engine for ``args`` with the ``rollout.*`` vLLM settings (``gpu_memory_utilization``,
        ``enable_sleep_mode``, ``vllm_dtype``, ``tensor_parallel_size``); on each rank of a
        torch.distributed job (``world_size > 1``) with the ``external_launcher`` executor.
        ``args.model`` is not used: vLLM loads its own copy from ``args.model_path``."""
        if args.lora:
            raise ConfigError("rollout.engine=vllm with model.lora_rank > 0 is not supported yet")
        cfg = args.cfg
        if cfg.tensor_parallel_size != 1:
            raise ConfigError(
                f"rollout.tensor_parallel_size={cfg.tensor_parallel_size}: rollout.engine=vllm "
                "pushes weights in place, which needs one GPU per engine (1); vLLM's "
                "external_launcher would also need every rank of a tensor-parallel group to "
                "send the same prompts"
            )
        launcher = {"distributed_executor_backend": EXTERNAL_LAUNCHER}
        return cls(
            args.model_path,
            args.tokenizer,
            cfg,
            seed=args.seed,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enable_sleep_mode=cfg.enable_sleep_mode,
            dtype=cfg.vllm_dtype,
            tensor_parallel_size=cfg.tensor_parallel_size,
            llm_kwargs=launcher if args.world_size > 1 else None,
        )

    def generate(
        self,
        prompts: Batch,
        *,
        greedy: bool = False,
        temperature: float | None = None,
        seed: int | None = None,
    ) -> Batch:
        """Sample one response per row of ``prompts`` (left-padded input_ids/attention_mask).

        Returns a new Batch: the input's non-tensors, meta and other tensors, plus prompts,
        responses, response_mask, input_ids, attention_mask, position_ids and
        rollout_log_probs as described in ``creditrl.batch.FIELDS``; T is the longest
        response. ``seed`` re-seeds the engine's generator first (rows without
        ``sample_seed`` draw their request seeds from it).
        """
        if self.asleep:
            raise RuntimeError(
                f"the vLLM engine is asleep ({sorted(self.asleep)} released): call wake_up() "
                "before generate()"
            )
        if self.weights_discarded:
            raise RuntimeError(
                "sleep(level=2) discarded the weights: call update_weights() before generate()"
            )
        if len(prompts) == 0:
            raise ValueError("generate() got an empty prompt batch")
        for name in ("input_ids", "attention_mask"):
            if name not in prompts.tensors:
                raise KeyError(
                    f"prompt batch has no tensor field {name!r} (fields: {prompts.keys()})"
                )
        params = sampling_params_of(self.cfg, greedy=greedy, temperature=temperature)
        token_lists = prompt_token_lists(
            prompts["input_ids"], prompts["attention_mask"], prompts.get("position_ids")
        )
        if seed is not None:
            self.generator.manual_seed(seed)
        seeds = None if params.greedy else request_seeds(prompts, self.generator)
        dicts = sampling_param_dicts(params, len(token_lists), seeds, self.eos_token_ids)
        requests = [{"prompt_token_ids": ids} for ids in token_lists]
        start = time.perf_counter()
        outputs = self.llm.generate(
            requests, [self.sampling_params_cls(**d) for d in dicts], use_tqdm=False
        )
        decode_s = time.perf_counter() - start
        out = assemble_rollout(
            prompts,
            completions_from_outputs(outputs),
            pad_token_id=self.pad_token_id,
            eos_token_ids=self.eos_token_ids,
            max_response_length=self.cfg.max_response_length,
        )
        self.last_stats = {
            "decode_s": decode_s,
            "requests": float(len(requests)),
            "prompt_tokens": float(sum(len(ids) for ids in token_lists)),
            "response_tokens": float(out["response_mask"].sum()),
        }
        return out

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        chunk_bytes: int = _DEFAULT_CHUNK_BYTES,
    ) -> int:
        """Load the trainer's weights into the engine in place; returns how many tensors.

        ``named_tensors``: Hugging Face names and full (unsharded) tensors, e.g.
        ``model.named_parameters()``, of any float dtype and device. They are handed over by
        reference in chunks of about ``chunk_bytes``, then the prefix cache (KV of the old
        weights) is reset. Needs the weights awake (``wake_up(tags=["weights"])``) and an
        in-process engine (see the class docstring).
        """
        if not self.in_process:
            raise RuntimeError(
                "in-place update_weights needs vLLM's engine core and its single worker in this "
                "process (in_process=True, tensor_parallel_size=1 and the uni-process executor, "
                "or external_launcher); for separate GPUs or tensor parallelism use vLLM's own "
                "weight transfer (vllm.config.WeightTransferConfig, 2026 releases)"
            )
        if "weights" in self.asleep:
            raise RuntimeError("the weights are asleep: call wake_up(tags=['weights']) first")
        count = 0
        for chunk in _weight_chunks(named_tensors, chunk_bytes):
            # one count per local worker: 1 (uni-process executor or external_launcher rank)
            counts = self.llm.collective_rpc("creditrl_load_weights", args=(chunk,))
            count += max(int(c) for c in counts)
        if count == 0:
            raise ValueError("update_weights got no tensors")
        self.weights_discarded = False
        self._reset_prefix_cache("update_weights")
        return count

    def sleep(self, level: int = 1) -> None:
        """Release vLLM's GPU memory: level 1 offloads the weights to CPU memory and drops the
        KV cache; level 2 drops both (push the weights again with ``update_weights`` after
        ``wake_up``). A no-op when asleep already or built without sleep mode."""
        if not self.enable_sleep_mode or self.asleep:
            return
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, got {level}")
        self.llm.sleep(level=level)
        self.asleep = {"weights", "kv_cache"}
        self.weights_discarded = level == 2

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore the released memory: all of it, or only ``tags`` (``"weights"`` first to
        update them without a KV cache allocated, then ``"kv_cache"``). No-op when awake."""
        wanted = set(self.asleep if tags is None else tags)
        unknown = wanted - {"weights", "kv_cache"}
        if unknown:
            raise ValueError(f"unknown wake_up tags {sorted(unknown)}; use 'weights', 'kv_cache'")
        wanted &= self.asleep
        if not wanted:
            return
        self.llm.wake_up(tags=None if wanted == {"weights", "kv_cache"} else sorted(wanted))
        self.asleep -= wanted
        if "kv_cache" in wanted:
            self._reset_prefix_cache("wake_up")

    def _reset_prefix_cache(self, after: str) -> None:
        """``LLM.reset_prefix_cache()``: KV blocks cached under the old weights or memory must
        not be reused. Recent releases return False (older ones None) when blocks are still
        held by running requests, which would leave them in place: a RuntimeError."""
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError(
                f"vLLM could not reset its prefix cache after {after} (requests still running)"
            )
