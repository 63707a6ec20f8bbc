"""The choices of ``creditrl export`` (no heavy imports: the CLI's parser reads them)."""

from __future__ import annotations

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "DTYPES"]

DTYPES = ("float32", "bfloat16", "float16")
# The Hub's recommended shard size; save_pretrained's own default is 50GB.
DEFAULT_MAX_SHARD_SIZE = "5GB"
