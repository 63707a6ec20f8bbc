"""Tokenizers, loaded once per directory and shared."""

from __future__ import annotations

import functools
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from creditrl.models.chat_template import check_chat_template
from creditrl.models.embedded import embedded_tokenizer_dir
from creditrl.models.loading import local_model_dir
from creditrl.models.model_dir import ModelError

__all__ = ["load_tokenizer"]


@functools.lru_cache(maxsize=16)
def _load(directory: str) -> PreTrainedTokenizerBase:
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, RecursionError) as err:
        reason = " ".join(str(err).split())[:300]
        raise ModelError(f"the tokenizer in {directory} cannot be loaded: {reason}") from None
    check_chat_template(tokenizer, Path(directory))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_tokenizer(path: str | Path, cache_dir: str | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of ``"embedded"`` or of a local model directory.

    Pad token = EOS when the tokenizer has none; ``padding_side="left"`` (prompts are
    left-padded). The object is cached per directory and shared between callers: do not mutate.
    ``"embedded"`` reads the tokenizer extracted from the GGUF, which is the same files as the
    converted model directory, without converting the weights. A local directory's files pass
    ``check_model_dir`` first and its chat template ``check_chat_template`` (one ``ModelError``
    line otherwise).
    """
    if str(path) == "embedded":
        directory = embedded_tokenizer_dir(cache_dir)
    else:
        directory = local_model_dir(path, required_file="tokenizer_config.json")
    return _load(str(directory))
