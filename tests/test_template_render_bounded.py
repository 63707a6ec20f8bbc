"""A chat template whose work explodes only on particular content passes the load-time check
(one sample conversation); every render of a dataset's prompt is bounded in time, and a row
that runs past it is dropped and counted (issue 40, item 12). The bound holds on any thread
(issue 50, item 5b)."""

from __future__ import annotations

import asyncio
import copy
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from creditrl.agents.chat import ChatFormat
from creditrl.agents.program import _unrenderable
from creditrl.agents.transcript import render_ids
from creditrl.data import dataset as dataset_module
from creditrl.data import render_bound
from creditrl.data.dataset import PromptDataset
from creditrl.data.render_bound import RenderTimeout, time_bound
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


# ---- the bound holds on any thread: the agent endpoint and the learner render off the main one


def _timed(fn, *args):
    start = time.monotonic()
    try:
        return fn(*args), time.monotonic() - start
    except Exception as err:  # handed back to the test
        return err, time.monotonic() - start


def test_a_render_past_its_time_is_refused_on_any_thread(monkeypatch) -> None:
    """The bound was a timer signal, which reaches the main thread only: the agent endpoint
    (``asyncio.to_thread``), episode threads and the learner's receiver rendered unbounded, so
    a template exploding on a request's content held a worker for minutes. Now each render on
    any thread is refused within the limit, in one line, and the thread goes on rendering."""
    monkeypatch.setattr(render_bound, "RENDER_TIME_S", 0.5)
    tok = copy.deepcopy(load_tokenizer(tiny_model_dir()))
    tok.chat_template = EXPLODES
    chat = ChatFormat(tok)
    boom = [{"role": "user", "content": "BOOM"}]
    calm = [{"role": "user", "content": "hi"}]

    def both(render) -> tuple:
        return _timed(render, boom), _timed(render, calm)

    endpoint = lambda msgs: render_ids(tok, msgs, None, True)  # noqa: E731
    ran: dict[str, tuple] = {}
    thread = threading.Thread(target=lambda: ran.update(thread=both(endpoint)))
    thread.start()
    thread.join(60)
    with ThreadPoolExecutor(1) as pool:  # as an episode thread or the learner's receiver
        ran["pool"] = pool.submit(both, lambda msgs: chat.render(msgs, True)).result(60)

    async def served() -> tuple:  # as the endpoint: off its event loop
        return await asyncio.to_thread(both, lambda msgs: chat.ids(msgs, True))

    ran["to_thread"] = asyncio.run(served())
    ran["main"] = both(endpoint)
    for where, ((refused, took), (rendered, _)) in ran.items():
        assert isinstance(refused, RenderTimeout), (where, refused)
        assert str(refused) == "did not render within 0.5 s" and took < 5, (where, took)
        assert not isinstance(rendered, Exception) and rendered, where
    line = str(_unrenderable(ran["to_thread"][0][0]))  # what the endpoint answers
    assert line == (
        "the chat template cannot render this request: RenderTimeout: did not render within 0.5 s"
    )


def test_a_bound_that_ended_never_fires_later() -> None:
    """Blocks on several threads that end just before or just after their 1 ms: each is
    refused inside its block or not at all, never after it."""
    failures: list[BaseException] = []
    refused = [0]

    def work(seed: int) -> None:
        sizes = random.Random(seed)
        for _ in range(300):
            try:
                with time_bound(0.001):
                    sum(range(sizes.randrange(1000, 60000)))  # about 0.05 to 3 ms
            except RenderTimeout:
                refused[0] += 1
            try:
                sum(range(5000))  # outside every block: nothing may arrive here
            except BaseException as err:
                failures.append(err)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not failures and refused[0] > 0
