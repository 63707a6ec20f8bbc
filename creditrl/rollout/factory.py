"""Choose the rollout engine from ``rollout.engine``: ``hf`` (CPU or GPU, transformers) or
``vllm`` (GPU, the optional extra)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase

from creditrl.config.schema import RolloutConfig
from creditrl.rollout.hf_engine import HFRolloutEngine
from creditrl.rollout.vllm_engine import VLLMRolloutEngine, vllm_unavailable_reason

__all__ = ["ROLLOUT_ENGINES", "build_rollout_engine"]

ROLLOUT_ENGINES = ("hf", "vllm")


def build_rollout_engine(
    model: PreTrainedModel | None,
    model_path: str | Path,
    tokenizer: PreTrainedTokenizerBase,
    cfg: RolloutConfig,
    seed: int = 0,
    *,
    llm_kwargs: Mapping[str, Any] | None = None,
) -> HFRolloutEngine | VLLMRolloutEngine:
    """The engine named by ``cfg.engine``.

    ``hf`` samples with ``model`` itself (its updates are visible at once). ``vllm`` loads its
    own copy of the weights from ``model_path`` (``model`` is not used) on the GPU, with
    ``cfg.gpu_memory_utilization``, ``cfg.enable_sleep_mode``, ``cfg.vllm_dtype`` and
    ``cfg.tensor_parallel_size``; push the trainer's weights with ``update_weights``.
    ``llm_kwargs`` go to ``vllm.LLM`` (e.g. ``{"distributed_executor_backend":
    "external_launcher"}`` on each rank of a torch.distributed job, ``{"load_format": "dummy"}``
    when the trainer's weights are pushed before the first rollout).
    """
    if cfg.engine == "hf":
        if model is None:
            raise ValueError("rollout.engine=hf samples with the actor's model: pass it")
        return HFRolloutEngine(model, tokenizer, cfg, seed=seed)
    if cfg.engine == "vllm":
        reason = vllm_unavailable_reason()
        if reason is not None:
            raise RuntimeError(f"rollout.engine=vllm: {reason}. On CPU use rollout.engine=hf.")
        return VLLMRolloutEngine(
            model_path,
            tokenizer,
            cfg,
            seed=seed,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enable_sleep_mode=cfg.enable_sleep_mode,
            dtype=cfg.vllm_dtype,
            tensor_parallel_size=cfg.tensor_parallel_size,
            llm_kwargs=llm_kwargs,
        )
    raise ValueError(f"rollout.engine must be one of {list(ROLLOUT_ENGINES)}, got {cfg.engine!r}")
