"""PromptDataset: prompt rows with the chat template applied once, as token ids."""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from creditrl.batch import Batch
from creditrl.data import render_bound
from creditrl.data.collate import collate_prompts
from creditrl.data.render_bound import RenderTimeout, time_bound
from creditrl.data.rows import PromptRow
from creditrl.data.teacher import teacher_messages
from creditrl.errors import ConfigError, DataError
from creditrl.usercode import one_line

__all__ = ["OVERLONG_MODES", "PromptDataset", "chat_prompt_ids", "max_token_chars", "prompt_chars"]

logger = logging.getLogger(__name__)

OVERLONG_MODES = ("drop", "raise")
RENDER_TIME_S = render_bound.RENDER_TIME_S  # one prompt's render (the load-time check's)


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
        _check_settings(tokenizer, max_prompt_length, overlong_prompt)
        pad = tokenizer.pad_token_id
        self.pad_token_id: int = tokenizer.eos_token_id if pad is None else pad
        self.split = split
        self.max_prompt_length = max_prompt_length
        self.num_dropped_overlap = 0
        render = _PromptRenderer(tokenizer, max_prompt_length, overlong_prompt, teacher_prompt)
        self._rows: list[dict[str, Any]] = []
        for row in rows:
            rendered = render.row(row)
            if rendered is not None:
                self._rows.append(self._item(row, *rendered))
        self.num_dropped_overlong = render.dropped_overlong
        self.num_unprivileged = render.unprivileged
        self.num_dropped_unrenderable = render.dropped_unrenderable
        self._log_drops(len(rows), teacher_prompt)
        self._check_left(len(rows), origin, render)

    def _item(self, row: PromptRow, ids: list[int], extra: dict[str, Any]) -> dict[str, Any]:
        """The dataset's item for ``row`` rendered as ``ids`` (and the teacher's ``extra``)."""
        return {
            "input_ids": ids,
            "raw_prompt": row.messages,
            "ground_truth": row.ground_truth,
            "data_source": row.data_source,
            "extra_info": {"split": self.split, **row.extra},
            "index": len(self._rows),
            "source": row.source,
            **extra,
        }

    def _log_drops(self, total: int, teacher_prompt: str) -> None:
        """Warn of the overlong prompts dropped and of the rows whose teacher sees the
        student's prompt, out of ``total`` rows."""
        if self.num_dropped_overlong:
            logger.warning(
                "%s: dropped %d of %d prompts longer than max_prompt_length=%d tokens",
                self.split,
                self.num_dropped_overlong,
                total,
                self.max_prompt_length,
            )
        if self.num_unprivileged:
            logger.warning(
                "%s: %d of %d rows have no ground truth (null or empty): the distillation "
                "teacher sees the student's prompt for them (distill.teacher_prompt=%s)",
                self.split,
                self.num_unprivileged,
                total,
                teacher_prompt,
            )

    def _check_left(self, total: int, origin: str | None, render: _PromptRenderer) -> None:
        """DataError naming ``origin`` when no prompt is left of ``total``: none given, none
        rendered in time, or all too long."""
        where = origin or self.split
        if not total:
            raise DataError(f"{where}: no prompts")
        if self._rows:
            return
        if render.dropped_unrenderable:
            raise DataError(
                f"{where}: {render.template} did not render within {RENDER_TIME_S:g} s on "
                f"{render.dropped_unrenderable} of {total} prompts, and no prompt is left"
            )
        shortest = (
            f"shortest: {render.shortest_overlong}"
            if render.shortest_overlong is not None
            else f"each over {render.most_chars} characters"
        )
        raise DataError(
            f"all {total} prompts of {where} are longer than "
            f"data.max_prompt_length={self.max_prompt_length} tokens after the chat template "
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


def _check_settings(tokenizer: Any, max_prompt_length: int, overlong_prompt: str) -> None:
    """ConfigError unless ``overlong_prompt`` is known, ``max_prompt_length >= 1`` and the
    tokenizer has a chat template."""
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


class _PromptRenderer:
    """Renders rows' prompts (and their distillation teacher's) within ``max_prompt_length``
    tokens, counting the rows it drops: too long (``dropped_overlong``; a DataError with
    ``overlong_prompt="raise"``), not rendered in time (``dropped_unrenderable``), and rows
    whose teacher sees the student's prompt (``unprivileged``)."""

    def __init__(
        self, tokenizer: Any, max_prompt_length: int, overlong_prompt: str, teacher_prompt: str
    ) -> None:
        self.tokenizer = tokenizer
        self.max_prompt_length = max_prompt_length
        self.overlong_prompt = overlong_prompt
        self.teacher_prompt = teacher_prompt
        name = getattr(tokenizer, "name_or_path", "") or "the model"
        self.template = f"the chat template of {name}"
        self.most_chars = max_prompt_length * max_token_chars(tokenizer)
        self.dropped_overlong = 0
        self.dropped_unrenderable = 0
        self.unprivileged = 0
        self.shortest_overlong: int | None = None

    def row(self, row: PromptRow) -> tuple[list[int], dict[str, Any]] | None:
        """The row's prompt ids and, with a teacher prompt other than ``same``, its
        ``teacher_prompt_ids``; None when the row is dropped."""
        ids = self.prompt_ids(row)
        if ids is None:
            return None
        if self.teacher_prompt == "same":
            return ids, {}
        teacher_ids = self.teacher_ids(row, ids)
        return None if teacher_ids is None else (ids, {"teacher_prompt_ids": teacher_ids})

    def prompt_ids(self, row: PromptRow) -> list[int] | None:
        """The row's chat-templated prompt ids; None when it is too long (its characters
        alone, or its ids) or not rendered in time."""
        chars = prompt_chars(row.messages)
        if chars > self.most_chars:
            self._overlong(
                f"{row.source}: prompt has {chars} characters, more than "
                f"data.max_prompt_length={self.max_prompt_length} tokens can hold "
                "(data.overlong_prompt=raise); raise the limit or shorten the prompt"
            )
            return None
        try:
            ids = chat_prompt_ids(self.tokenizer, row.messages)
        except RenderTimeout as e:
            self.dropped_unrenderable += 1
            logger.warning("%s: dropped: %s %s", row.source, self.template, e)
            return None
        except Exception as e:
            raise DataError(
                f"{row.source}: the chat template failed: {type(e).__name__}: {one_line(e)}"
            ) from e
        if len(ids) > self.max_prompt_length:
            self._overlong(
                f"{row.source}: prompt has {len(ids)} tokens after the chat template, "
                f"more than data.max_prompt_length={self.max_prompt_length} "
                "(data.overlong_prompt=raise); raise the limit or shorten the prompt"
            )
            self.shortest_overlong = min(len(ids), self.shortest_overlong or len(ids))
            return None
        return ids

    def teacher_ids(self, row: PromptRow, ids: list[int]) -> list[int] | None:
        """The teacher's prompt ids (the student's ``ids`` when ``teacher_messages`` has
        nothing privileged to show, counted); None when too long or not rendered in time."""
        teacher = teacher_messages(row, self.teacher_prompt)
        self.unprivileged += teacher is None
        try:
            teacher_ids = ids if teacher is None else chat_prompt_ids(self.tokenizer, teacher)
        except RenderTimeout as e:
            self.dropped_unrenderable += 1
            logger.warning("%s: dropped: %s %s (teacher prompt)", row.source, self.template, e)
            return None
        if len(teacher_ids) > self.max_prompt_length:
            self._overlong(
                f"{row.source}: the distillation teacher's prompt has "
                f"{len(teacher_ids)} tokens, more than "
                f"data.max_prompt_length={self.max_prompt_length} "
                "(data.overlong_prompt=raise); raise the limit"
            )
            return None
        return teacher_ids

    def _overlong(self, message: str) -> None:
        """DataError(``message``) with ``overlong_prompt="raise"``, else count the drop."""
        if self.overlong_prompt == "raise":
            raise DataError(message)
        self.dropped_overlong += 1
