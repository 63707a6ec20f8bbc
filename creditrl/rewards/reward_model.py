"""Reward model: a sequence classifier (num_labels=1) scoring the decoded conversation.

The conversation is the prompt's chat messages (``raw_prompt``) plus the decoded response as the
assistant turn, rendered with the reward model's own tokenizer and chat template (its vocabulary
may differ from the policy's). The score lands on the last valid response token (``rm_scores``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from creditrl.batch import Batch
from creditrl.config.schema import RewardModelConfig
from creditrl.core import place_sequence_scores
from creditrl.models.chat_template import check_chat_template
from creditrl.models.loading import from_local, local_model_dir
from creditrl.rewards.text import Messages, decode_responses, prompt_messages

__all__ = ["RewardModelWorker"]

log = logging.getLogger(__name__)


class RewardModelWorker:
    """Loads ``cfg.path`` (a local directory) as AutoModelForSequenceClassification, num_labels=1.

    The tokenizer comes from the same directory; if it has none, the policy ``tokenizer`` is used
    (same vocabulary assumed; a warning is logged). Without a chat template the conversation is
    the message contents joined by newlines.
    """

    def __init__(
        self, cfg: RewardModelConfig, tokenizer: Any, device: str | torch.device = "cpu"
    ) -> None:
        if not cfg.path or not Path(cfg.path).is_dir():
            raise FileNotFoundError(f"reward.reward_model.path {cfg.path!r} is not a directory")
        directory = local_model_dir(cfg.path)
        if cfg.micro_batch_size < 1:
            raise ValueError(f"reward_model.micro_batch_size must be >= 1: {cfg.micro_batch_size}")
        self.cfg = cfg
        self.tokenizer = tokenizer
        try:
            self.rm_tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
        except (OSError, ValueError):
            log.warning("no tokenizer in %s; using the policy tokenizer for the RM", cfg.path)
            self.rm_tokenizer = tokenizer
        else:
            check_chat_template(self.rm_tokenizer, directory)
        if self.rm_tokenizer.pad_token_id is None:
            self.rm_tokenizer.pad_token = self.rm_tokenizer.eos_token
        self.device = torch.device(device)
        self.model = from_local(
            AutoModelForSequenceClassification, directory, torch.float32, None, num_labels=1
        ).to(self.device)
        self.model.eval()
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.rm_tokenizer.pad_token_id

    def render(self, conversation: Messages) -> str:
        """The conversation as the RM's input text."""
        if getattr(self.rm_tokenizer, "chat_template", None):
            return self.rm_tokenizer.apply_chat_template(conversation, tokenize=False)
        return "\n".join(str(m.get("content", "")) for m in conversation)

    @torch.no_grad()
    def score_conversations(self, conversations: list[Messages]) -> torch.Tensor:
        """(n,) float32: the RM's scalar output for each conversation (micro-batched)."""
        texts = [self.render(c) for c in conversations]
        out = []
        self.rm_tokenizer.padding_side = "right"
        for start in range(0, len(texts), self.cfg.micro_batch_size):
            enc = self.rm_tokenizer(
                texts[start : start + self.cfg.micro_batch_size],
                padding=True,
                return_tensors="pt",
                add_special_tokens=False,
            ).to(self.device)
            logits = self.model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"])
            out.append(logits.logits[:, 0].float().cpu())
        return torch.cat(out) if out else torch.zeros(0)

    def compute_rm_score(
        self, batch: Batch, response_texts: list[str] | None = None
    ) -> torch.Tensor:
        """rm_scores (B, T) float32: each conversation's score on its last valid response token.

        ``response_texts`` default: the responses' ``response_mask`` tokens decoded with the
        policy tokenizer (skip_special_tokens=True).
        """
        if response_texts is None:
            response_texts = decode_responses(batch, self.tokenizer)
        conversations = [
            [*prompt_messages(batch, i), {"role": "assistant", "content": text}]
            for i, text in enumerate(response_texts)
        ]
        scores = self.score_conversations(conversations)
        return place_sequence_scores(scores, batch["response_mask"].cpu()).to(torch.float32)
