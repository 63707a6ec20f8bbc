"""A checkpoint's actor as a model, and that model written as a Hugging Face (or peft) directory.

The actor is rebuilt exactly as training built it (``model.path`` in ``model.dtype``, LoRA
adapters when ``model.lora_rank > 0``) and given the checkpoint's weights by
``creditrl.workers.checkpoint_io.load_trainable``, the code that resumes a run (sharded
checkpoints are gathered there). Writing goes through ``save_pretrained`` only.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from creditrl.config import Config
from creditrl.errors import DataError, UserError
from creditrl.exporting.sources import RunCheckpoint
from creditrl.models import apply_lora, load_causal_lm, resolve_model_path
from creditrl.weights.tensors import merged_model
from creditrl.workers.checkpoint_io import load_trainable

__all__ = ["export_tokenizer", "load_actor", "write_adapter", "write_merged"]

# Config attributes that say where the weights came from rather than what the model is: the
# embedded model's GGUF name (general.name, kept by transformers' GGUF loader).
ORIGIN_CONFIG_KEYS = ("_model_name_or_path", "gguf_file")
# Tokenizer init kwargs that are how a directory was read, not part of the tokenizer.
LOAD_KWARGS = ("local_files_only", "is_local", "gguf_file", "cache_dir", "_commit_hash")


def load_actor(ckpt: RunCheckpoint, cfg: Config) -> torch.nn.Module:
    """The run's actor (a peft model under LoRA) with ``ckpt``'s weights, in eval mode."""
    try:
        base = resolve_model_path(cfg.model.path, cfg.model.cache_dir)
    except FileNotFoundError as err:
        raise DataError(f"{ckpt.config_file}: model.path: {err}") from None
    model = load_causal_lm(base, cfg.model.dtype)
    if cfg.model.lora_rank > 0:
        model = apply_lora(
            model, cfg.model.lora_rank, cfg.model.lora_alpha, cfg.model.target_modules
        )
    try:
        load_trainable(ckpt.directory, "actor", ckpt.actor_meta, model, None, None)
    except UserError:
        raise
    except (FileNotFoundError, KeyError, RuntimeError, ValueError) as err:
        reason = " ".join(str(err).split())[:300]
        raise DataError(
            f"checkpoint {ckpt.directory}: its actor weights do not fit the model its "
            f"config.yaml describes (model.path={cfg.model.path}, "
            f"model.lora_rank={cfg.model.lora_rank}): {reason}"
        ) from None
    return model.eval()


def write_merged(
    model: torch.nn.Module, out: Path, dtype: torch.dtype, max_shard_size: int | str
) -> None:
    """The full model (LoRA adapters merged into their layers) as safetensors in ``dtype``,
    with config.json and generation_config.json; shards past ``max_shard_size``. A LoRA head
    tied to the embeddings is written untied (``tie_word_embeddings`` false): the merge changes
    the head only."""
    model = merged_model(model)  # merged at training precision, then cast
    model = model.to(dtype)
    for key in ORIGIN_CONFIG_KEYS:
        model.config.__dict__.pop(key, None)
    model.save_pretrained(str(out), max_shard_size=max_shard_size)


def write_adapter(model: torch.nn.Module, out: Path, dtype: torch.dtype) -> None:
    """The LoRA adapters alone as a peft directory (adapter_config.json and
    adapter_model.safetensors in ``dtype``); its base is the run's ``model.path``."""
    model.to(dtype).save_pretrained(str(out))


def export_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of ``model_dir`` (chat template included) as an export saves it."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    for key in LOAD_KWARGS:
        tokenizer.init_kwargs.pop(key, None)
    return tokenizer
