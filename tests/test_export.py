"""Take the model out: ``creditrl export`` / ``creditrl.export`` write a Hugging Face directory
that plain transformers (and peft) load in a process without creditrl, with the checkpoint
actor's log-probs; ``creditrl eval`` takes runs, checkpoints and exports and reproduces the
run's validation; bad input is one line and exit 2, with nothing half-written."""

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import read_metrics, tiny_trainer_config
from huggingface_hub import ModelCard
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import creditrl
from creditrl.cli import main
from creditrl.exporting.evaluate import plan_eval, validation_metrics
from creditrl.inspect.models import build_batch, compute_log_probs
from creditrl.models.tiny import tiny_model_dir
from creditrl.models.tokenizer import load_tokenizer
from creditrl.trainers.checkpoint import CheckpointManager
from creditrl.trainers.rl_trainer import RLTrainer
from creditrl.workers.hybrid import HybridWorker

# A deterministic score that varies with every character of the response, so GRPO has a signal
# in 2 steps and a validation score pins down the exact greedy responses.
SCORER = """
def char_sum(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return (sum(map(ord, solution_str)) % 97) / 96
"""
PROMPT = [{"role": "user", "content": "What is 3 + 4? Answer in <answer></answer> tags."}]
RESPONSES = ["<answer>7</answer>", "Let me think: 3 + 4 = 7, so <answer>7</answer>"]

# Runs in a fresh interpreter (-I: no user site, no PYTHON* variables, no cwd on sys.path)
# with creditrl made unimportable: the export must need transformers (and peft) only.
FRESH = r"""
import json, sys

class NoCreditrl:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] == "creditrl":
            raise ImportError("creditrl must not be needed to load an export")

sys.meta_path.insert(0, NoCreditrl())
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

job = json.loads(sys.argv[1])
out = {}
for name, spec in job["models"].items():
    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    model = AutoModelForCausalLM.from_pretrained(spec["base"], dtype=torch.float32)
    if "adapter" in spec:
        from peft import PeftModel
        model = PeftModel.from_pretrained(model, spec["adapter"])
    model.eval()
    prompt = tokenizer.apply_chat_template(
        job["prompt"], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    rows = []
    for text in job["responses"]:
        response_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt_ids + response_ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits.float()
        logp = torch.log_softmax(logits[0, len(prompt_ids) - 1 : -1], dim=-1)
        picked = logp.gather(-1, torch.tensor(response_ids)[:, None])[:, 0]
        rows.append({"response_ids": response_ids, "log_probs": picked.tolist()})
    out[name] = {"prompt_ids": prompt_ids, "rows": rows}
out["creditrl_imported"] = any(m.split(".")[0] == "creditrl" for m in sys.modules)
print(json.dumps(out))
"""


def run_fresh(models: dict[str, dict[str, str]]) -> dict:
    job = json.dumps({"models": models, "prompt": PROMPT, "responses": RESPONSES})
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-I", "-c", FRESH, job],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def train(out: Path, *extra: str) -> Path:
    scorer = out.parent / "char_sum.py"
    scorer.write_text(SCORER)
    cfg = tiny_trainer_config(
        out, f"reward.scorer={scorer}:char_sum", "reward.num_workers=0", *extra
    )
    RLTrainer(cfg).fit()
    return out


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A finished 2-step GRPO run of the tiny model (checkpoints of steps 1 and 2)."""
    return train(tmp_path_factory.mktemp("full") / "run", "actor.optim.lr=1e-2")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory) -> Path:
    return train(
        tmp_path_factory.mktemp("lora") / "run",
        "model.lora_rank=4",
        "model.lora_alpha=8",
        "actor.optim.lr=5e-2",
    )


def checkpoint_log_probs(run_dir: Path, step: int = 2) -> tuple[list[int], list[torch.Tensor]]:
    """The fixed responses' log-probs under the checkpoint's actor, restored by the code that
    resumes a run and computed by the trainer's actor worker (temperature 1)."""
    cfg = tiny_trainer_config(run_dir, "trainer.resume=never")
    cfg.model.lora_rank, cfg.model.lora_alpha = _lora(run_dir)
    worker = HybridWorker(cfg, roles=("actor",))
    directory = run_dir / "checkpoints" / f"step_{step:06d}"
    parts = json.loads((directory / "state.json").read_text())["parts"]
    assert worker.load_checkpoint(str(directory), parts) is None
    tokenizer = load_tokenizer(tiny_model_dir())
    prompt = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    responses = [tokenizer(r, add_special_tokens=False)["input_ids"] for r in RESPONSES]
    batch = build_batch([prompt_ids] * len(responses), responses, tokenizer.pad_token_id)
    log_probs, _ = compute_log_probs(worker.actor.model, batch, cfg)
    return prompt_ids, [log_probs[i, : len(r)] for i, r in enumerate(responses)]


def _lora(run_dir: Path) -> tuple[int, int]:
    from creditrl.config.loader import load_config

    cfg = load_config(run_dir / "config.yaml")
    return cfg.model.lora_rank, cfg.model.lora_alpha


def assert_same_log_probs(fresh: dict, prompt_ids: list[int], expected: list[torch.Tensor]):
    assert fresh["prompt_ids"] == prompt_ids  # the exported tokenizer and chat template
    for row, want in zip(fresh["rows"], expected, strict=True):
        got = torch.tensor(row["log_probs"])
        assert got.shape == want.shape
        torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=0)


def one_error_line(capsys) -> str:
    out = capsys.readouterr()
    text = (out.out + out.err).strip()
    lines = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


# ---- export: what plain transformers loads ----------------------------------------------------


def test_export_loads_without_creditrl_with_the_checkpoints_log_probs(
    run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "model"
    assert main(["export", str(run), str(out)]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "README.md"} <= names
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= names
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "float32" and config["model_type"] == "llama"
    assert not [k for k in config if "gguf" in k or "name_or_path" in k or "quantiz" in k]
    prompt_ids, expected = checkpoint_log_probs(run)
    _, base = checkpoint_log_probs(run, step=1)
    assert max((a - b).abs().max() for a, b in zip(expected, base, strict=True)) > 1e-3
    fresh = run_fresh({"export": {"base": str(out), "tokenizer": str(out)}})
    assert fresh["creditrl_imported"] is False
    assert_same_log_probs(fresh["export"], prompt_ids, expected)


def test_lora_run_exports_merged_weights_or_the_adapter(lora_run: Path, tmp_path: Path) -> None:
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    creditrl.export(lora_run, merged)
    result = creditrl.export(lora_run, adapter, adapter=True)
    assert result.step == 2 and "adapter_config.json" in result.files
    assert not (adapter / "config.json").exists()
    adapter_config = json.loads((adapter / "adapter_config.json").read_text())
    assert adapter_config["r"] == 4 and adapter_config["lora_alpha"] == 8
    assert not [k for k in load_file(str(merged / "model.safetensors")) if "lora" in k]
    prompt_ids, expected = checkpoint_log_probs(lora_run)
    fresh = run_fresh(
        {
            "base": {"base": str(tiny_model_dir()), "tokenizer": str(merged)},
            "merged": {"base": str(merged), "tokenizer": str(merged)},
            "adapter": {
                "base": str(tiny_model_dir()),
                "adapter": str(adapter),
                "tokenizer": str(adapter),
            },
        }
    )
    assert (
        max(
            (torch.tensor(row["log_probs"]) - want).abs().max()
            for row, want in zip(fresh["base"]["rows"], expected, strict=True)
        )
        > 1e-3
    )  # the adapters moved the policy, so equality below means they were exported
    assert_same_log_probs(fresh["merged"], prompt_ids, expected)
    assert_same_log_probs(fresh["adapter"], prompt_ids, expected)


def shard_checkpoint(run_dir: Path, out: Path) -> Path:
    """A copy of ``run_dir`` whose step-2 checkpoint is in the sharded format of 2 ranks (each
    tensor of 2+ rows split along dimension 0 as fsdp2 shards it), written by the manager."""
    shutil.copytree(run_dir, out, ignore=shutil.ignore_patterns("checkpoints"))
    source = run_dir / "checkpoints" / "step_000002"
    payload = json.loads((source / "state.json").read_text())
    meta = payload["parts"]["actor"]
    full = load_file(str(source / "actor.model.safetensors"))

    def write_parts(directory: str) -> dict:
        split = [k for k, v in full.items() if v.dim() >= 1 and v.shape[0] >= 2]
        split += [a for a, k in meta["model_aliases"].items() if k in split]  # as fsdp2 lists them
        for rank in range(2):
            part = {k: v.chunk(2)[rank].clone() if k in split else v for k, v in full.items()}
            save_file(part, f"{directory}/actor.model.rank{rank}.safetensors")
        sharded = {"format": "sharded", "world_size": 2, "model_sharded": split}
        return {"actor": {**sharded, "model_aliases": meta["model_aliases"]}, "world_size": 2}

    CheckpointManager(out / "checkpoints").save(2, write_parts, payload["state"])
    return out


def test_a_sharded_checkpoint_is_gathered(run: Path, tmp_path: Path) -> None:
    sharded = shard_checkpoint(run, tmp_path / "sharded_run")
    assert (sharded / "checkpoints" / "step_000002" / "actor.model.rank1.safetensors").is_file()
    creditrl.export(sharded, tmp_path / "from_shards")
    creditrl.export(run, tmp_path / "from_full")
    a = load_file(str(tmp_path / "from_shards" / "model.safetensors"))
    b = load_file(str(tmp_path / "from_full" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_dtype_and_shards(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "bf16"
    args = ["--dtype", "bfloat16", "--max-shard-size", "5MB"]
    assert main(["export", str(run), str(out), *args]) == 0
    assert not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    tensors = {}
    for shard in shards:
        tensors.update(load_file(str(out / shard)))
    full = load_file(str(run / "checkpoints" / "step_000002" / "actor.model.safetensors"))
    for key, value in tensors.items():
        assert value.dtype == torch.bfloat16
        assert torch.equal(value, full[key].to(torch.bfloat16)), key


def test_model_card_records_what_the_run_recorded(run: Path, tmp_path: Path) -> None:
    creditrl.export(run, tmp_path / "model", step=1)
    card = ModelCard.load(tmp_path / "model" / "README.md")
    assert card.data.library_name == "transformers"
    assert "grpo" in card.data.tags and card.data.base_model is None  # a local base model
    metrics = read_metrics(run)
    text = card.text
    assert f"| `val/score` | {metrics[0]['val/score']:.4f} |" in text
    assert "after step" not in text  # step 1 was not validated (trainer.test_freq=2)
    assert "- steps: 1 of `trainer.total_steps=2`" in text
    assert "| `data.train_size` | `24` |" in text and "`data.max_prompt_length`" not in text
    assert f"creditrl {creditrl.__version__}" in text and "char_sum" in text
    creditrl.export(run, tmp_path / "last")
    last = ModelCard.load(tmp_path / "last" / "README.md").text
    before, after = metrics[0]["val/score"], metrics[2]["val/score"]
    assert f"| `val/score` | {before:.4f} | {after:.4f} |" in last


def test_the_base_models_origin_does_not_leak(run: Path, tmp_path: Path) -> None:
    """A base directory like the embedded model's conversion (the GGUF's name in config.json,
    loader kwargs in tokenizer_config.json) exports without them."""
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir(), base)
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "_model_name_or_path": "Smollm2"}))
    tok = json.loads((base / "tokenizer_config.json").read_text())
    tok.update(local_files_only=True, is_local=True)
    (base / "tokenizer_config.json").write_text(json.dumps(tok))
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    text = (copy / "config.yaml").read_text().replace(str(tiny_model_dir()), str(base))
    (copy / "config.yaml").write_text(text)
    creditrl.export(copy, tmp_path / "model")
    assert "_model_name_or_path" not in json.loads((tmp_path / "model/config.json").read_text())
    exported = json.loads((tmp_path / "model" / "tokenizer_config.json").read_text())
    assert "local_files_only" not in exported and "is_local" not in exported


# ---- eval ------------------------------------------------------------------------------------


def eval_lines(capsys) -> dict[str, str]:
    out = capsys.readouterr().out
    return dict(line.split(": ", 1) for line in out.splitlines() if line.startswith("val/"))


def test_eval_of_a_run_a_checkpoint_and_an_export_reproduces_the_last_validation(
    run: Path, tmp_path: Path, capsys
) -> None:
    last = read_metrics(run)[2]["val/score"]
    assert 0 < last < 1
    listing = sorted(p.relative_to(run).as_posix() for p in run.rglob("*"))
    config = (run / "config.yaml").read_text()
    assert main(["eval", str(run), "--trust-run-code"]) == 0  # the run's scorer is a file
    assert eval_lines(capsys)["val/score"] == f"{last:.4f}"
    step2 = run / "checkpoints" / "step_000002"
    assert main(["eval", f"model.path={step2}", "--trust-run-code"]) == 0
    assert eval_lines(capsys)["val/score"] == f"{last:.4f}"
    out = tmp_path / "model"
    creditrl.export(run, out)
    plan = plan_eval([str(run / "config.yaml"), str(out)])
    assert validation_metrics(plan.config_for(plan.targets[0]))["val/score"] == last
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == listing
    assert (run / "config.yaml").read_text() == config  # eval writes nothing into the run


def test_eval_compare_base_and_run_gives_the_runs_before_and_after(run: Path, capsys) -> None:
    metrics = read_metrics(run)
    assert main(["eval", "--compare", str(tiny_model_dir()), str(run), "--trust-run-code"]) == 0
    line = eval_lines(capsys)["val/score"]
    before, after = metrics[0]["val/score"], metrics[2]["val/score"]
    assert line == f"{before:.4f} -> {after:.4f} ({after - before:+.4f})"


# ---- bad input -------------------------------------------------------------------------------


def test_not_a_run_or_checkpoint_is_one_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    assert main(["export", str(tmp_path / "empty"), str(tmp_path / "out")]) == 2
    assert "is neither a run directory" in one_error_line(capsys)
    assert main(["export", str(tiny_model_dir()), str(tmp_path / "out")]) == 2
    assert "is a Hugging Face model directory" in one_error_line(capsys)
    assert main(["eval", str(tmp_path / "empty")]) == 2
    assert "is not 'embedded', a run directory" in one_error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_a_step_that_does_not_exist_is_one_line(run: Path, tmp_path: Path, capsys) -> None:
    assert main(["export", str(run), str(tmp_path / "out"), "--step", "7"]) == 2
    assert "has no checkpoint of step 7 (it has 1, 2)" in one_error_line(capsys)
    step2 = run / "checkpoints" / "step_000002"
    assert main(["export", str(step2), str(tmp_path / "out"), "--step", "1"]) == 2
    assert "is the checkpoint of step 2, not of --step 1" in one_error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_overwrite_replaces_an_earlier_export_and_nothing_else(
    run: Path, tmp_path: Path, capsys
) -> None:
    """A folder of the user's files is never deleted, with or without --overwrite; an earlier
    export (its marker lists what it wrote) is replaced, unless files were added to it."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    assert main(["export", str(run), str(mine)]) == 2
    assert "is not empty" in one_error_line(capsys)
    assert main(["export", str(run), str(mine), "--overwrite"]) == 2
    assert f"OUT_DIR {mine} is not an earlier export" in one_error_line(capsys)
    assert [p.name for p in mine.iterdir()] == ["notes.txt"]
    out = tmp_path / "out"
    assert main(["export", str(run), str(out), "--step", "1"]) == 0
    marker = json.loads((out / "creditrl_export.json").read_text())
    assert marker["step"] == 1 and "model.safetensors" in marker["files"]
    assert sorted(marker["files"] + ["creditrl_export.json"]) == sorted(os.listdir(out))
    assert main(["export", str(run), str(out), "--overwrite"]) == 0
    assert json.loads((out / "creditrl_export.json").read_text())["step"] == 2
    (out / "eval_notes.md").write_text("mine")
    (out / "plots").mkdir()
    assert main(["export", str(run), str(out), "--overwrite"]) == 2
    assert "holds 'eval_notes.md', 'plots', which creditrl export did not write" in (
        one_error_line(capsys)
    )
    assert (out / "eval_notes.md").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "out"]  # no temporary left


@pytest.mark.parametrize(
    ("where", "why"),
    [
        (".", "is the current directory"),
        ("~", "is your home directory"),
        ("/", "is the file system's root"),
        ("RUN", "is the run directory"),
        ("RUN/..", "is the run directory"),
        ("RUN/checkpoints", "is inside the run's checkpoints/ folder"),
        ("RUN/checkpoints/new", "is inside the run's checkpoints/ folder"),
    ],
)
def test_out_dirs_that_hold_the_users_files_are_refused(
    run: Path, tmp_path: Path, monkeypatch, capsys, where: str, why: str
) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    for folder in (home, work):
        folder.mkdir()
        (folder / "mine.txt").write_text("mine")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    listing = sorted(p.relative_to(run).as_posix() for p in run.rglob("*"))
    out = where.replace("RUN", str(run))
    assert main(["export", str(run), out, "--overwrite"]) == 2
    shown = str(home) if out == "~" else out
    assert f"OUT_DIR {shown} {why}" in one_error_line(capsys)
    for folder in (home, work):
        assert [p.name for p in folder.iterdir()] == ["mine.txt"]  # no ..old-* left behind
    assert sorted(p.relative_to(run).as_posix() for p in run.rglob("*")) == listing


def test_a_failed_write_is_one_line_and_leaves_the_earlier_export(
    run: Path, tmp_path: Path, capsys, monkeypatch
) -> None:
    (tmp_path / "file.txt").write_text("mine")
    assert main(["export", str(run), str(tmp_path / "file.txt" / "model")]) == 2
    assert "is below the file" in one_error_line(capsys)
    out = tmp_path / "out"
    creditrl.export(run, out, step=1)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def disk_full(model, directory, *args) -> None:
        (directory / "model.safetensors").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr("creditrl.exporting.exporter.write_merged", disk_full)
    assert main(["export", str(run), str(out), "--overwrite"]) == 2
    line = one_error_line(capsys)
    assert f"cannot write OUT_DIR {out}: No space left on device" in line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    deep = tmp_path / "a" / "b" / "model"
    assert main(["export", str(run), str(deep)]) == 2
    assert f"cannot write OUT_DIR {deep}" in one_error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "out"]


@pytest.mark.parametrize(
    "text",
    [
        'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space '
        'left on device" })',
        "Error while serializing: I/O error: No space left on device (os error 28)",
    ],
)
def test_a_full_disk_in_the_safetensors_writer_is_one_line(
    run: Path, tmp_path: Path, capsys, monkeypatch, text: str
) -> None:
    """The safetensors writer reports a full disk as a SafetensorError, not an OSError: it was
    a traceback, not the one line the docs promise."""
    out = tmp_path / "out"

    def disk_full(*args, **kwargs) -> None:
        raise SafetensorError(text)

    monkeypatch.setattr("transformers.modeling_utils.safe_save_file", disk_full)
    assert main(["export", str(run), str(out)]) == 2
    line = one_error_line(capsys)
    assert f"cannot write OUT_DIR {out}: No space left on device; nothing was written" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_cards_how_to_load_snippet_runs(run: Path, tmp_path: Path) -> None:
    """The card's code, run as written against the installed transformers, offline, with the
    export's path for its name."""
    out = tmp_path / "model"
    creditrl.export(run, out)
    card = (out / "README.md").read_text()
    code = card.split("## How to load")[1].split("```python\n")[1].split("```")[0]
    assert code.count('"model"') == 2
    code = code.replace('"model"', json.dumps(str(out)))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    done = subprocess.run(
        [sys.executable, "-I", "-c", code], capture_output=True, text=True, env=env, cwd="/"
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_a_damaged_checkpoint_is_one_line_or_skipped(run: Path, tmp_path: Path, capsys) -> None:
    damaged = tmp_path / "run"
    shutil.copytree(run, damaged)
    weights = damaged / "checkpoints" / "step_000002" / "actor.model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main(["export", str(damaged), str(tmp_path / "a"), "--step", "2"]) == 2
    line = one_error_line(capsys)
    assert "step_000002 is damaged (actor.model.safetensors: truncated to 1000 of" in line
    assert main(["export", str(damaged), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "checkpoint step_000002 (actor.model.safetensors: truncated" in out
    assert "exported the model of step 1" in out
    assert not (tmp_path / "a").exists()


def test_other_bad_options_are_one_line_and_leave_nothing(
    run: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "out"
    assert main(["export", str(run), str(out), "--adapter"]) == 2
    assert "--adapter needs a LoRA run" in one_error_line(capsys)
    assert main(["export", str(run), str(out), "--max-shard-size", "lots"]) == 2
    assert "is not a positive size" in one_error_line(capsys)
    with pytest.raises(creditrl.errors.UserError, match="dtype 'int8' is not one of"):
        creditrl.export(run, out, dtype="int8")
    assert list(tmp_path.iterdir()) == []  # nothing half-written, no temporary directory


def test_a_bad_actor_meta_in_state_json_is_one_line(run: Path, tmp_path: Path, capsys) -> None:
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    CheckpointManager(copy / "checkpoints").save(
        3, lambda d: {"actor": {"format": "sharded", "world_size": 10**9}}, {}
    )
    assert main(["export", str(copy), str(tmp_path / "out")]) == 2
    assert "parts.actor.world_size must be an integer in 1..4096" in one_error_line(capsys)
