"""``distill.*`` checked when a config is loaded: the settings that go together, the teacher's
path, and its tokenizer, which must be the student's (the teacher scores the student's token
ids, so another vocabulary would score other tokens). Each problem is one ``ConfigError``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from creditrl.config.limits import check_yaml
from creditrl.config.run_files import run_file_text
from creditrl.config.schema import Config
from creditrl.errors import ConfigError, UserError

__all__ = ["check_distill", "teacher_tokenizer_path"]


def _run_model_path(run_dir: Path, teacher: str) -> str:
    """``model.path`` of the run at ``run_dir`` (its config.yaml, read by ``run_file_text``)."""
    path = run_dir / "config.yaml"
    where = f"distill.teacher={teacher!r}: {path}"
    try:
        text = run_file_text(path)
        check_yaml(text, str(path))
        tree: Any = yaml.safe_load(text)
    except ConfigError as err:
        raise ConfigError(f"distill.teacher={teacher!r}: {err}") from None
    except yaml.YAMLError as err:
        reason = " ".join(str(err).split())[:200]
        raise ConfigError(f"{where} cannot be read: {reason}") from None
    model = tree.get("model") if isinstance(tree, dict) else None
    value = model.get("path", "embedded") if isinstance(model, dict) else "embedded"
    if not isinstance(value, str):
        raise ConfigError(f"{where}: model.path is not a string")
    return value


def teacher_tokenizer_path(cfg: Config) -> str | None:
    """The model directory (or ``"embedded"``) whose tokenizer the teacher has: None for
    ``self`` (the student's own); a run or checkpoint's ``model.path``; else the directory."""
    teacher = cfg.distill.teacher
    if teacher is None or teacher == "self":
        return None
    if teacher == "embedded":
        return teacher
    path = Path(teacher).expanduser()
    if (path / "checkpoints").is_dir():
        return _run_model_path(path, teacher)
    if path.parent.name == "checkpoints" and path.is_dir():
        return _run_model_path(path.parent.parent, teacher)
    if (path / "config.json").is_file():
        return teacher
    raise ConfigError(
        f"distill.teacher={teacher!r} is not 'self', 'embedded', a model directory "
        "(config.json), a run directory (checkpoints/) or a run's checkpoints/step_NNNNNN"
    )


def _check_tokenizer(cfg: Config, teacher_path: str) -> None:
    from creditrl.models import load_tokenizer

    if teacher_path == cfg.model.path:
        return
    try:
        student = load_tokenizer(cfg.model.path, cfg.model.cache_dir).get_vocab()
        teacher = load_tokenizer(teacher_path, cfg.model.cache_dir).get_vocab()
    except (UserError, OSError) as err:
        reason = " ".join(str(err).split())[:200]
        raise ConfigError(f"distill.teacher={cfg.distill.teacher!r}: {reason}") from None
    if student == teacher:
        return
    odd = sorted(set(student.items()) ^ set(teacher.items()))[:1]
    example = f"; first difference: token {odd[0][0]!r}" if odd else ""
    raise ConfigError(
        f"distill.teacher={cfg.distill.teacher!r} has another vocabulary than model.path "
        f"({len(teacher)} vs {len(student)} tokens{example}): the teacher scores the student's "
        "token ids, so both need the same tokenizer"
    )


def check_distill(cfg: Config, loss_reads_teacher: bool, agent_task: bool) -> None:
    """One ``ConfigError`` for the first ``distill.*`` problem: a policy loss that reads
    ``teacher_log_prob`` (``loss_reads_teacher``) without a teacher; a teacher prompt the rows
    cannot give (``few_shot`` needs data.task rows; an agent task, ``agent_task``, builds its
    own prompts); a teacher path that is none of the accepted kinds; another vocabulary."""
    d = cfg.distill
    if d.teacher is None:
        if loss_reads_teacher:
            raise ConfigError(
                f"actor.policy_loss={cfg.actor.policy_loss} trains on a teacher's log-probs: "
                "set distill.teacher (self, embedded, a model, run or checkpoint directory)"
            )
        return
    if d.teacher_prompt != "same" and agent_task:
        raise ConfigError(
            f"distill.teacher_prompt={d.teacher_prompt} with data.task={cfg.data.task!r}: an "
            "agent task builds its own prompts; use distill.teacher_prompt=same"
        )
    if d.teacher_prompt == "few_shot" and (cfg.data.train_files or not cfg.data.task):
        raise ConfigError(
            "distill.teacher_prompt=few_shot shows data.task's worked examples, and the prompts "
            "come from data.train_files; use distill.teacher_prompt=ground_truth or same"
        )
    teacher_path = teacher_tokenizer_path(cfg)
    if teacher_path is not None:
        _check_tokenizer(cfg, teacher_path)
