"""A chat template whose work explodes only on particular content passes the load-time check
(one sample conversation); every render of a dataset's prompt is bounded in time, and a row
that runs past it is dropped and counted (issue 40, item 12)."""

from __future__ import annotations

import copy

import pytest

from creditrl.data import dataset as dataset_module
from creditrl.data.dataset import PromptDataset
from creditrl.data.rows import PromptRow
from creditrl.errors import DataError
from creditrl.models import load_tokenizer
from creditrl.models.tiny import tiny_model_dir

# 4000 x 4000 empty iterations on a message holding BOOM: seconds to minutes of Jinja work
EXPLODES = (
    "{% for m in messages %}{% if 'BOOM' in m['content'] %}"
    "{% for i in range(4000) %}{% for j in range(4000) %}{% endfor %}{% endfor %}"
    "{% endif %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _row(text: str, number: int) -> PromptRow:
    return PromptRow([{"role": "user", "content": text}], "1", "user", {}, f"row {number}")


@pytest.fixture
def tokenizer(monkeypatch):
    monkeypatch.setattr(dataset_module, "RENDER_TIME_S", 0.2)
    tok = copy.deepcopy(load_tokenizer(tiny_model_dir()))
    tok.chat_template = EXPLODES
    return tok


def test_a_render_past_its_time_drops_and_counts_the_row(tokenizer, caplog) -> None:
    rows = [_row("What is 1 + 1?", 1), _row("BOOM", 2), _row("What is 2 + 2?", 3)]
    data = PromptDataset(rows, tokenizer, 256, "drop", "train", "data.train_files")
    assert [r["source"] for r in data] == ["row 1", "row 3"]
    assert data.num_dropped_unrenderable == 1
    assert "did not render within 0.2 s" in caplog.text and "row 2" in caplog.text


def test_a_template_that_renders_no_row_in_time_is_one_line(tokenizer) -> None:
    with pytest.raises(DataError) as raised:
        PromptDataset([_row("BOOM", 1)], tokenizer, 256, "drop", "train", "data.train_files")
    message = str(raised.value)
    assert "\n" not in message and "chat template" in message
    assert str(tiny_model_dir()) in message and "did not render within 0.2 s" in message


def test_a_teacher_prompt_past_its_time_drops_and_counts_the_row(tokenizer) -> None:
    """The distillation teacher's prompt (here: the ground truth shown to it) is rendered under
    the same bound."""
    rows = [_row("What is 1 + 1?", 1), _row("What is 2 + 2?", 2)]
    rows[1].ground_truth = "BOOM"
    data = PromptDataset(rows, tokenizer, 256, "drop", "train", "data.train_files", "ground_truth")
    assert [r["source"] for r in data] == ["row 1"] and data.num_dropped_unrenderable == 1
