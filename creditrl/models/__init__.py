"""Models: the embedded SmolLM2 (converted once from GGUF), loaders for actor / reference /
LoRA, the critic (backbone + value head), tokenizers, and a tiny random model for tests."""

from creditrl.models.cache import cache_root
from creditrl.models.critic import CriticModel
from creditrl.models.embedded import (
    embedded_gguf_path,
    embedded_model_dir,
    embedded_tokenizer_dir,
)
from creditrl.models.loading import (
    apply_lora,
    disabled_adapters,
    load_causal_lm,
    load_reference,
    resolve_model_path,
    torch_dtype,
)
from creditrl.models.tiny import tiny_model_dir
from creditrl.models.tokenizer import load_tokenizer

__all__ = [
    "CriticModel",
    "apply_lora",
    "cache_root",
    "disabled_adapters",
    "embedded_gguf_path",
    "embedded_model_dir",
    "embedded_tokenizer_dir",
    "load_causal_lm",
    "load_reference",
    "load_tokenizer",
    "resolve_model_path",
    "tiny_model_dir",
    "torch_dtype",
]
