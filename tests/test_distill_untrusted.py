"""On-policy distillation's inputs from outside: the teacher's weights and run directory, the
rows' ground truth it is shown, and the teacher log-probs a sampler sends. Each is refused in
one line at load, or rejected and counted during a run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import model_group, tiny_trainer_config
from transformers import LlamaForCausalLM

from creditrl.asynchronous.messages import decode, episodes_message
from creditrl.asynchronous.validation import MessageError
from creditrl.config import load_config
from creditrl.data import build_datasets
from creditrl.errors import ConfigError
from creditrl.models import load_causal_lm, load_tokenizer
from creditrl.models.embedded import copy_tokenizer_files, embedded_tokenizer_dir
from creditrl.models.tiny import tiny_config, tiny_model_dir
from creditrl.trainers.rl_trainer import RLTrainer


def test_a_teacher_with_a_smaller_embedding_is_refused_at_load(tmp_path: Path) -> None:
    """The student's tokenizer files over a 1000-row embedding passed the vocabulary check
    and ended in the teacher's forward with an IndexError (a device-side assert on CUDA)."""
    small = tmp_path / "small"
    config = tiny_config()
    config.vocab_size = 1000
    LlamaForCausalLM(config).save_pretrained(str(small))
    copy_tokenizer_files(embedded_tokenizer_dir(), small)
    cfg = tiny_trainer_config(tmp_path / "run", f"distill.teacher={small}")
    with pytest.raises(ConfigError, match=r"embeds 1000 token ids, fewer than the 49152") as err:
        RLTrainer(cfg)
    assert str(err.value).startswith(f"distill.teacher='{small}'") and "\n" not in str(err.value)


def test_rows_without_ground_truth_get_no_privileged_prompt_and_are_counted(
    tmp_path: Path, caplog
) -> None:
    """Before, a null or empty ground truth told the teacher "a correct final answer is
    null." and distilled toward it, uncounted."""
    rows = tmp_path / "rows.jsonl"
    gts = [None, "", "  ", [], "42"]
    lines = [{"prompt": f"q{i}", "ground_truth": a, "data_source": "t"} for i, a in enumerate(gts)]
    rows.write_text("".join(json.dumps(line) + "\n" for line in lines))
    cfg = load_config(
        overrides=[f"model.path={tiny_model_dir()}", f"data.train_files=[{rows}]",
                   "distill.teacher=self", "distill.teacher_prompt=ground_truth"]
    )  # fmt: skip
    tok = load_tokenizer(tiny_model_dir())
    with caplog.at_level("WARNING"):
        train, _ = build_datasets(cfg.data, tok, cfg.distill)
    assert train.num_unprivileged == 4
    assert "4 of 5 rows have no ground truth" in caplog.text
    for i in range(4):
        assert train[i]["teacher_prompt_ids"] == train[i]["input_ids"]
        assert "correct final answer" not in tok.decode(train[i]["teacher_prompt_ids"])
    assert "a correct final answer is 42" in tok.decode(train[4]["teacher_prompt_ids"])
    assert "teacher_prompt_ids" in train.batch([0, 4])  # a mixed batch keeps its column


def test_teacher_log_probs_from_a_sampler_are_bounded_in_magnitude() -> None:
    """-3e38 is finite and <= 0, so it passed every check; the float32 sums overflowed and
    every step's update was skipped: one hostile sampler stopped all training."""
    group = model_group(load_causal_lm(tiny_model_dir()), "s0", 0, 0)
    group["teacher_log_prob"] = group["rollout_log_probs"].clone()
    group["teacher_log_prob"][0, 0] = -1e4
    decode(episodes_message("s0", 0, group))
    for bad in (-3e38, -1e4 - 1):
        group["teacher_log_prob"][0, 0] = bad
        with pytest.raises(MessageError, match="teacher_log_prob holds log-probs below -10000"):
            decode(episodes_message("s0", 0, group))
