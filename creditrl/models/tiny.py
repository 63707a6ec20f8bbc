"""A tiny random Llama with the real SmolLM2 tokenizer, for tests and smoke runs."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

from creditrl.models.cache import build_once, cache_root
from creditrl.models.embedded import copy_tokenizer_files, embedded_tokenizer_dir

__all__ = ["tiny_config", "tiny_model_dir", "write_tiny_model"]

_VERSION = 1  # bump when the architecture below changes, so caches rebuild


def tiny_config() -> LlamaConfig:
    """2 layers, hidden 64, 4 heads (2 KV heads), SmolLM2's vocabulary and special ids."""
    return LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def write_tiny_model(out_dir: Path, seed: int, tokenizer_dir: Path) -> None:
    """Write the tiny model with weights drawn from ``seed`` and the tokenizer files."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_config())
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model.save_pretrained(str(out_dir))
    copy_tokenizer_files(tokenizer_dir, out_dir)


def tiny_model_dir(cache_dir: str | None = None, seed: int = 0) -> Path:
    """A cached directory holding a tiny random Llama (same weights for the same seed) with the
    real tokenizer and chat template. The first call extracts the tokenizer from the GGUF
    (~8 s); later calls return the path at once."""
    tokenizer_dir = embedded_tokenizer_dir(cache_dir)
    target = cache_root(cache_dir) / f"tiny-llama-v{_VERSION}-seed{seed}"
    return build_once(target, lambda out: write_tiny_model(out, seed, tokenizer_dir))
