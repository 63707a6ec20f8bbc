"""A run directory someone sent is data: ``creditrl export``, ``eval``, ``explain`` and
``report`` read its config.yaml without importing the ``trainer.extensions`` it names or running
the code it names, unless the user passes ``--trust-run-code``; a setting only such code makes
valid is one line naming the extension and the flag."""

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import restore_registries, tiny_trainer_config
from test_run_files import within

from creditrl.batch import Batch
from creditrl.cli import main
from creditrl.config.loader import save_resolved_config
from creditrl.config.run_config import load_run_config
from creditrl.core import POLICY_LOSSES
from creditrl.errors import ConfigError
from creditrl.exporting.evaluate import plan_eval
from creditrl.models import load_causal_lm
from creditrl.models.tiny import tiny_model_dir
from creditrl.models.tokenizer import load_tokenizer
from creditrl.tracking.rollout_dump import RolloutDumper
from creditrl.trainers.checkpoint import CheckpointManager
from creditrl.trainers.rl_trainer import RLTrainer
from creditrl.workers.checkpoint_io import save_trainable

RAN = "extension_ran"
# Leaves a file beside itself when imported: the proof that a command ran the run's code.
EXTENSION = f"""
from pathlib import Path

Path(__file__).with_name({RAN!r}).write_text("ran")
"""
LOSS_EXTENSION = (
    EXTENSION
    + """
from creditrl.core import compute_policy_loss_ppo, register_policy_loss

register_policy_loss("ppo_from_the_run")(compute_policy_loss_ppo)
"""
)


@pytest.fixture(autouse=True)
def policy_losses(monkeypatch: pytest.MonkeyPatch) -> None:
    """The loss registry as it was before the test, afterwards."""
    restore_registries(monkeypatch, POLICY_LOSSES)


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory of the tiny model (config.yaml, a step-1 checkpoint of the untrained
    weights, a rollout dump of step 1, metrics.jsonl), made without training."""
    run = tmp_path_factory.mktemp("plain") / "run"
    run.mkdir()
    cfg = tiny_trainer_config(run)
    save_resolved_config(cfg, run / "config.yaml")
    model = load_causal_lm(tiny_model_dir(), cfg.model.dtype)
    CheckpointManager(run / "checkpoints").save(
        1, lambda d: {"actor": save_trainable(Path(d), "actor", model, None, None)}, {}
    )
    mask = torch.tensor([[1, 1, 1]])
    batch = Batch(
        {
            "prompts": torch.tensor([[504, 1032]]),
            "responses": torch.tensor([[330, 331, 2]]),
            "input_ids": torch.tensor([[504, 1032, 330, 331, 2]]),
            "attention_mask": torch.ones(1, 5, dtype=torch.long),
            "response_mask": mask,
            "token_level_scores": torch.tensor([[0.0, 0.0, 1.0]]),
            "token_level_rewards": torch.tensor([[0.0, 0.0, 1.0]]),
        },
        {"uid": ["a"], "data_source": ["toy"], "ground_truth": ["1"]},
    )
    tokenizer = load_tokenizer(tiny_model_dir())
    RolloutDumper(run, rows_per_step=1, tokenizer=tokenizer).dump(batch, step=1)
    (run / "metrics.jsonl").write_text('{"step": 1, "critic/score/mean": 0.5}\n')
    return run


def sent_run(plain_run: Path, where: Path, extension: str, **settings: object) -> Path:
    """A copy of ``plain_run`` in ``where`` whose config.yaml names ``./ext.py`` (shipped in
    the run directory, as an archive would) among its ``trainer.extensions``, with
    ``settings`` (``section.key``: value) changed."""
    import shutil

    run = where / "sent_run"
    shutil.copytree(plain_run, run)
    (run / "ext.py").write_text(extension)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["trainer"]["extensions"] = ["./ext.py"]
    for key, value in settings.items():
        section, leaf = key.split(".")
        config[section][leaf] = value
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    return run


def error_line(capsys: pytest.CaptureFixture[str], prefix: str = "error:") -> str:
    out = capsys.readouterr()
    text = (out.out + out.err).strip()
    lines = [line for line in text.splitlines() if line.startswith(prefix)]
    assert len(lines) == 1 and "Traceback" not in text, text
    return lines[0]


def flat_output(capsys: pytest.CaptureFixture[str]) -> str:
    """Everything printed, as one line (explain's console wraps long lines)."""
    out = capsys.readouterr()
    assert "Traceback" not in out.out + out.err
    return " ".join((out.out + out.err).split())


def test_export_explain_and_report_of_a_sent_run_run_none_of_its_code(
    plain_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """The extension resolves from the current directory (the unpacked run), as it did for
    the sender; reading the run imports it nowhere, and the run's own settings still apply."""
    run = sent_run(plain_run, tmp_path, EXTENSION)
    monkeypatch.chdir(run)
    assert main(["export", str(run), str(tmp_path / "model")]) == 0
    assert (tmp_path / "model" / "model.safetensors").is_file()
    assert main(["explain", str(run), "--tsv", "--columns", "token,score"]) == 0
    assert "\t1" in capsys.readouterr().out  # the dumped score of the last token
    assert main(["report", str(run), "--out", str(tmp_path / "report"), "--no-png"]) == 0
    assert (tmp_path / "report" / "index.html").is_file()
    assert not (run / RAN).exists()


def test_a_setting_only_the_runs_extension_makes_valid_names_it_and_the_flag(
    plain_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    run = sent_run(plain_run, tmp_path, LOSS_EXTENSION, **{"actor.policy_loss": "ppo_from_the_run"})
    monkeypatch.chdir(run)
    for argv in (["export", str(run), str(tmp_path / "model")], ["explain", str(run)]):
        assert main(argv) == 2
        line = error_line(capsys) if argv[0] == "export" else flat_output(capsys)
        assert "actor.policy_loss='ppo_from_the_run' is not one of" in line
        assert "trainer.extensions (./ext.py)" in line and "--trust-run-code" in line
    assert not (run / RAN).exists() and not (tmp_path / "model").exists()
    assert main(["export", str(run), str(tmp_path / "model"), "--trust-run-code"]) == 0
    assert (run / RAN).is_file() and (tmp_path / "model" / "model.safetensors").is_file()


def test_eval_of_a_run_that_names_code_needs_the_flag(
    plain_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    """eval would run the run's scorer, estimator or extensions: refused in one line naming
    them; with the flag, or the setting overridden away, the plan is made."""
    run = sent_run(plain_run, tmp_path, EXTENSION, **{"reward.scorer": "./score.py:score"})
    monkeypatch.chdir(run)
    assert main(["eval", str(run)]) == 2
    line = error_line(capsys)
    assert "trainer.extensions=['./ext.py']" in line and "reward.scorer='./score.py:score'" in line
    assert "--trust-run-code" in line
    assert not (run / RAN).exists()
    plan = plan_eval([str(run), "trainer.extensions=[]", "reward.scorer=null"])
    assert plan.from_run and not (run / RAN).exists()
    plan = plan_eval([str(run)], trust_run_code=True)
    assert plan.config_file == run / "config.yaml" and (run / RAN).is_file()


def _config_in_subprocess(*overrides: str) -> subprocess.CompletedProcess[str]:
    """``creditrl config OVERRIDES`` in a child bounded in time and address space (a reader
    that hangs or grows without bound fails the test instead of the machine)."""

    def bounded() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))

    return subprocess.run(
        [sys.executable, "-m", "creditrl.cli", "config", *overrides],
        capture_output=True,
        text=True,
        timeout=180,
        preexec_fn=bounded,
    )


def test_a_teacher_runs_config_yaml_gets_the_model_directory_file_checks(tmp_path: Path) -> None:
    """distill.teacher naming a run whose config.yaml is a FIFO hung `creditrl train`; one
    linking to /dev/zero grew to 23 GB in 28 s. Now each is one line, as in a model directory;
    a link to a file outside the run is refused too."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    config = run / "config.yaml"
    outside = tmp_path / "elsewhere.yaml"
    outside.write_text("model:\n  path: embedded\n")
    for make, said in (
        (lambda: os.mkfifo(config), "config.yaml is a FIFO, not a regular file"),
        (lambda: config.symlink_to("/dev/zero"), "config.yaml: a link to /dev/zero, outside"),
        (lambda: config.symlink_to(outside), f"config.yaml: a link to {outside}, outside"),
    ):
        config.unlink(missing_ok=True)
        make()
        done = _config_in_subprocess(f"model.path={tiny_model_dir()}", f"distill.teacher={run}")
        assert done.returncode == 2, done.stdout + done.stderr
        lines = done.stdout.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"error: distill.teacher='{run}'"), lines
        assert said in lines[0]
    with pytest.raises(ConfigError, match=r"a link to .*elsewhere\.yaml, outside the run"):
        load_run_config(config)


def test_a_teacher_runs_extension_refusal_names_what_train_accepts(
    plain_run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refusal told `creditrl train` users to pass --trust-run-code, which train does not
    accept: it names trainer.extensions, which train imports."""
    run = sent_run(plain_run, tmp_path, LOSS_EXTENSION, **{"actor.policy_loss": "ppo_from_the_run"})
    monkeypatch.chdir(run)
    cfg = tiny_trainer_config(tmp_path / "student", f"distill.teacher={run}")
    with pytest.raises(ConfigError, match=r"policy_loss='ppo_from_the_run' is not one") as err:
        RLTrainer(cfg)
    line = str(err.value)
    assert line.startswith(f"distill.teacher='{run}': ")
    assert "\n" not in line and "--trust-run-code" not in line
    assert "list them in trainer.extensions of the config you train with" in line
    assert not (run / RAN).exists()


def _copy(plain_run: Path, where: Path) -> Path:
    import shutil

    run = where / "run"
    shutil.copytree(plain_run, run)
    return run


def test_export_and_eval_read_the_runs_metrics_with_the_run_file_checks(
    plain_run: Path, tmp_path: Path, capsys
) -> None:
    """The model card's read of metrics.jsonl (export, and eval through its export) took a FIFO
    for no file (nothing said) and a line nested 500,000 deep was a RecursionError."""
    run = _copy(plain_run, tmp_path)
    metrics = run / "metrics.jsonl"
    good = metrics.read_text()
    metrics.unlink()
    os.mkfifo(metrics)
    for argv in (["export", str(run), str(tmp_path / "model")], ["eval", str(run)]):
        assert within(120, main, argv, fifo=metrics) == 2
        assert f"{metrics} is a FIFO, not a regular file" in error_line(capsys)
    assert not (tmp_path / "model").exists()
    metrics.unlink()
    metrics.write_text(good + "[" * 500_000 + "]" * 500_000 + "\n")
    assert main(["export", str(run), str(tmp_path / "model")]) == 0
    assert "metrics.jsonl: 1 unreadable lines skipped" in flat_output(capsys)


def test_export_overwrite_onto_a_fifo_marker_is_one_line_not_a_hang(
    plain_run: Path, tmp_path: Path, capsys
) -> None:
    out = tmp_path / "model"
    out.mkdir()
    os.mkfifo(out / "creditrl_export.json")
    argv = ["export", str(plain_run), str(out), "--overwrite"]
    assert within(120, main, argv, fifo=out / "creditrl_export.json") == 2
    assert "creditrl_export.json is a FIFO, not a regular file" in error_line(capsys)


def test_a_checkpoints_json_files_are_checked_before_they_are_read(
    plain_run: Path, tmp_path: Path
) -> None:
    """export, eval and a run as distill.teacher find a run's checkpoint with find_checkpoint,
    which reads manifest.json and state.json only as regular files of the checkpoint."""
    from creditrl.errors import DataError
    from creditrl.pipeline.teacher import load_teacher

    run = _copy(plain_run, tmp_path)
    state = run / "checkpoints" / "step_000001" / "state.json"
    state.unlink()
    os.mkfifo(state)
    cfg = tiny_trainer_config(tmp_path / "student", f"distill.teacher={run}")
    with pytest.raises(DataError, match=r"step_000001 \(state\.json: not a regular file\)"):
        within(120, load_teacher, cfg, 16, fifo=state)
