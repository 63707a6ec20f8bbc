"""PromptDataset: prompt rows with the chat template applied once, as token ids."""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from creditrl.batch import Batch
from creditrl.data.collate import collate_prompts
from creditrl.data.render_bound import RenderTimeout, time_bound
from creditrl.data.rows import PromptRow
from creditrl.data.teacher import teacher_messages
from creditrl.errors import ConfigError, DataError
from creditrl.usercode import one_line

__all__ = ["OVERLONG_MODES", "PromptDataset", "chat_prompt_ids", "max_token_chars", "prompt_chars"]

logger = logging.getLogger(__name__)

OVERLONG_MODES = ("drop", "raise")
RENDER_TIME_S = 5.0  # one prompt's render: the budget of the template's load-time check


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Token ids of ``messages`` under the tokenizer's chat template, ending with the
    generation prompt (``add_generation_prompt=True``); RenderTimeout past ``RENDER_TIME_S``
    (``creditrl.data.render_bound``)."""
    with time_bound(RENDER_TIME_S):
        ids = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    if isinstance(ids, Mapping):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` can stand for: the longest entry of its
    vocabulary (byte-level BPE spells each byte as one character, and a decoded character
    takes at least one byte; a byte-fallback entry such as ``<0x41>`` is longer than what it
    stands for)."""
    return max(map(len, tokenizer.get_vocab()), default=1)


def prompt_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of the messages' text contents, less surrounding whitespace (a chat template
    may trim it)."""
    return sum(len(m["content"].strip()) for m in messages if isinstance(m.get("content"), str))


class PromptDataset:
    """Rows ready for rollout. Each item is a dict:

    ``input_ids`` (list[int], the chat-templated prompt), ``raw_prompt`` (the messages),
    ``ground_truth``, ``data_source``, ``extra_info`` (the row's extra plus ``split``),
    ``index`` (position in this dataset) and ``source`` (file and row, for humans); with a
    ``teacher_prompt`` other than ``same`` (``creditrl.data.teacher``), also
    ``teacher_prompt_ids``: the distillation teacher's chat-templated prompt, held to the same
    ``max_prompt_length`` (a row whose teacher prompt is longer is dropped or raises likewise);
    a row with nothing privileged to show (``teacher_messages`` None: no ground truth) gets the
    student's prompt ids there, counted in ``num_unprivileged`` and logged.

    Prompts longer than ``max_prompt_length`` tokens are dropped and counted
    (``num_dropped_overlong``, logged) or, with ``overlong_prompt="raise"``, raise DataError
    naming the row; one whose text has more characters than ``max_prompt_length`` tokens could
    ever spell (``max_token_chars``) is known to be too long before it is tokenized, in time
    linear in its characters; when every prompt is too long, DataError names ``origin``
    (where the rows came from, e.g. the files) and the shortest length.
    ``num_dropped_overlap`` counts task rows dropped for repeating validation.
    A prompt the chat template does not render within ``RENDER_TIME_S`` (a template whose work
    explodes on its content) is dropped, counted (``num_dropped_unrenderable``) and logged;
    when no prompt is left, DataError names the template.
    """

    def __init__(
        self,
        rows: Sequence[PromptRow],
        tokenizer: Any,
        max_prompt_length: int,
        overlong_prompt: str = "drop",
        split: str = "train",
        origin: str | None = None,
        teacher_prompt: str = "same",
    ) -> None:
        if overlong_prompt not in OVERLONG_MODES:
            raise ConfigError(
                f"data.overlong_prompt must be one of {OVERLONG_MODES}, got {overlong_prompt!r}"
            )
        if max_prompt_length < 1:
            raise ConfigError(f"data.max_prompt_length must be >= 1, got {max_prompt_length}")
        if getattr(tokenizer, "chat_template", None) is None:
            raise ConfigError(
                "model.path: the tokenizer has no chat template; prompts need one "
                "(use a chat/instruct model)"
            )
        pad = tokenizer.pad_token_id
        self.pad_token_id: int = tokenizer.eos_token_id if pad is None else pad
        self.split = split
        self.max_prompt_length = max_prompt_length
        self.num_dropped_overlong = 0
        self.num_dropped_overlap = 0
        self.num_unprivileged = 0
        self.num_dropped_unrenderable = 0
        template = f"the chat template of {getattr(tokenizer, 'name_or_path', '') or 'the model'}"
        self._rows: list[dict[str, Any]] = []
        shortest_overlong: int | None = None
        most_chars = max_prompt_length * max_token_chars(tokenizer)
        for row in rows:
            chars = prompt_chars(row.messages)
            if chars > most_chars:
                if overlong_prompt == "raise":
                    raise DataError(
                        f"{row.source}: prompt has {chars} characters, more than "
                        f"data.max_prompt_length={max_prompt_length} tokens can hold "
                        "(data.overlong_prompt=raise); raise the limit or shorten the prompt"
                    )
                self.num_dropped_overlong += 1
                continue
            try:
                ids = chat_prompt_ids(tokenizer, row.messages)
            except RenderTimeout as e:
                self.num_dropped_unrenderable += 1
                logger.warning("%s: dropped: %s %s", row.source, template, e)
                continue
            except Exception as e:
                raise DataError(
                    f"{row.source}: the chat template failed: {type(e).__name__}: {one_line(e)}"
                ) from e
            if len(ids) > max_prompt_length:
                if overlong_prompt == "raise":
                    raise DataError(
                        f"{row.source}: prompt has {len(ids)} tokens after the chat template, "
                        f"more than data.max_prompt_length={max_prompt_length} "
                        "(data.overlong_prompt=raise); raise the limit or shorten the prompt"
                    )
                self.num_dropped_overlong += 1
                shortest_overlong = min(len(ids), shortest_overlong or len(ids))
                continue
            extra: dict[str, Any] = {}
            if teacher_prompt != "same":
                teacher = teacher_messages(row, teacher_prompt)
                self.num_unprivileged += teacher is None
                try:
                    teacher_ids = ids if teacher is None else chat_prompt_ids(tokenizer, teacher)
                except RenderTimeout as e:
                    self.num_dropped_unrenderable += 1
                    logger.warning("%s: dropped: %s %s (teacher prompt)", row.source, template, e)
                    continue
                extra["teacher_prompt_ids"] = teacher_ids
                if len(extra["teacher_prompt_ids"]) > max_prompt_length:
                    if overlong_prompt == "raise":
                        raise DataError(
                            f"{row.source}: the distillation teacher's prompt has "
                            f"{len(extra['teacher_prompt_ids'])} tokens, more than "
                            f"data.max_prompt_length={max_prompt_length} "
                            "(data.overlong_prompt=raise); raise the limit"
                        )
                    self.num_dropped_overlong += 1
                    continue
            self._rows.append(
                {
                    "input_ids": ids,
                    "raw_prompt": row.messages,
                    "ground_truth": row.ground_truth,
                    "data_source": row.data_source,
                    "extra_info": {"split": split, **row.extra},
                    "index": len(self._rows),
                    "source": row.source,
                    **extra,
                }
            )
        if self.num_dropped_overlong:
            logger.warning(
                "%s: dropped %d of %d prompts longer than max_prompt_length=%d tokens",
                split,
                self.num_dropped_overlong,
                len(rows),
                max_prompt_length,
            )
        if self.num_unprivileged:
            logger.warning(
                "%s: %d of %d rows have no ground truth (null or empty): the distillation "
                "teacher sees the student's prompt for them (distill.teacher_prompt=%s)",
                split,
                self.num_unprivileged,
                len(rows),
                teacher_prompt,
            )
        if not rows:
            raise DataError(f"{origin or split}: no prompts")
        if not self._rows and self.num_dropped_unrenderable:
            raise DataError(
                f"{origin or split}: {template} did not render within {RENDER_TIME_S:g} s on "
                f"{self.num_dropped_unrenderable} of {len(rows)} prompts, and no prompt is left"
            )
        if not self._rows:
            shortest = (
                f"shortest: {shortest_overlong}"
                if shortest_overlong is not None
                else f"each over {most_chars} characters"
            )
            raise DataError(
                f"all {len(rows)} prompts of {origin or split} are longer than "
                f"data.max_prompt_length={max_prompt_length} tokens after the chat template "
                f"({shortest}); raise data.max_prompt_length"
            )

    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        """A copy of row ``index`` (safe to mutate)."""
        return copy.deepcopy(self._rows[index])

    def batch(self, indices: Sequence[int]) -> Batch:
        """The prompt Batch of rows ``indices`` (``collate_prompts`` with this pad id)."""
        return collate_prompts([self[i] for i in indices], self.pad_token_id)
