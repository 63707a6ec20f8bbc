"""Text views of a batch for scoring: decoded responses and prompt chat messages.

Text is for rewards, logs and humans only; training always uses the token ids.
"""

from __future__ import annotations

from typing import Any

from creditrl.batch import Batch

__all__ = ["Messages", "decode_responses", "prompt_messages"]

Messages = list[dict[str, Any]]


def decode_responses(batch: Batch, tokenizer: Any) -> list[str]:
    """Each response's tokens with ``response_mask`` 1, decoded with skip_special_tokens=True."""
    responses, mask = batch["responses"].cpu(), batch["response_mask"].bool().cpu()
    ids = [row[m].tolist() for row, m in zip(responses, mask, strict=True)]
    return tokenizer.batch_decode(ids, skip_special_tokens=True)


def prompt_messages(batch: Batch, index: int) -> Messages:
    """Sample ``index``'s prompt as chat messages (``raw_prompt``: a messages list or text)."""
    if "raw_prompt" not in batch:
        raise KeyError("the reward model needs the non-tensor field 'raw_prompt' (chat messages)")
    prompt = batch["raw_prompt"][index]
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list | tuple) and all(isinstance(m, dict) for m in prompt):
        return [dict(m) for m in prompt]
    raise TypeError(f"sample {index}: raw_prompt must be text or chat messages, got {prompt!r}")
