"""The config is the one place a run is refused: choices, ranges, combinations, paths, YAML and
override mistakes are one-line errors (exit code 2); unused settings are one-line warnings."""

import math
from pathlib import Path

import pytest
import torch
from helpers import (
    TinyCritic,
    padded_actor_batch,
    padded_batch,
    refused,
    restore_registries,
    tiny_lm,
)

from creditrl.cli import describe_sizes, main
from creditrl.config import ActorConfig, Config, CriticConfig, DataConfig, OptimConfig
from creditrl.config.loader import PRESETS, all_keys, load_config, load_config_with_sources
from creditrl.config.validate import CHOICES, schema_fields
from creditrl.config.verl_names import VERL_NAMES
from creditrl.errors import ConfigError, DataError

CHOICE_REFUSALS = [
    "model.dtype=float64",
    "data.overlong_prompt=truncate",
    "rollout.engine=sglang",
    "rollout.vllm_dtype=fp8",
    "reward.reward_model.mode=multiply",
    "actor.optim.lr_scheduler=linear",
    "critic.optim.lr_scheduler=linear",
    "actor.policy_loss=vanila",
    "actor.loss_agg_mode=token_mean",
    "critic.loss_agg_mode=seq-mean",
    "actor.kl_loss_type=full",
    "algorithm.kl_penalty=k4",
    "algorithm.kl_penalty=full+",
    "actor.autocast=fp16",
    "algorithm.adv_estimator=grpo2",
    "algorithm.kl_ctrl.type=linear",
    "algorithm.rollout_is.level=batch",
    "algorithm.rollout_is.mode=clip",
    "algorithm.filter_groups.metric=acc",
    "trainer.backend=slurm",
    "trainer.strategy=fsdp",
    "trainer.fsdp_param_dtype=fp8",
    "trainer.critic_placement=remote",
    "trainer.checkpoint_format=gguf",
    "trainer.resume=always",
    "trainer.ray.placement_strategy=pack",
    "trainer.logger=[jsonl,wandbb]",
    "asynchronous.ref_on=both",
    "asynchronous.old_log_probs=rollout",
    "asynchronous.lora_sync=full",
    "agent.truncate_side=both",
    "agent.reward_manager=dense",
    "agent.reward_distribution=uniform",
]


@pytest.mark.parametrize("override", CHOICE_REFUSALS)
def test_choice_keys_refuse_other_values(capsys, override: str) -> None:
    """Every choice-valued key refuses a value outside its choices, naming key and value."""
    key, value = override.split("=", 1)
    line = refused(capsys, override)
    assert key in line and "is not one of" in line
    assert value.strip("[]").split(",")[-1] in line


@pytest.mark.parametrize(
    "override,nearest",
    [
        ("actor.loss_agg_mode=token_mean", "token-mean"),
        ("algorithm.adv_estimator=GRPO", "grpo"),
        ("trainer.ray.placement_strategy=pack", "PACK"),
        ("trainer.logger=[jsnl]", "jsonl"),
        ("algorithm.kl_penalty=low_var", "low_var_kl"),
    ],
)
def test_choice_errors_suggest_the_nearest_value(override: str, nearest: str) -> None:
    """The refusal names the nearest valid value."""
    with pytest.raises(ConfigError, match=f"did you mean '{nearest}'"):
        load_config(overrides=[override])


def test_choices_come_from_the_registries(monkeypatch) -> None:
    """A user-registered policy loss is accepted; '+' KL variants and user-code estimators
    (path/to/file.py:name) are accepted; removed 'full' KL is not."""
    from creditrl.core import POLICY_LOSSES

    restore_registries(monkeypatch, POLICY_LOSSES)
    POLICY_LOSSES.register("my_loss")(POLICY_LOSSES.get("ppo"))
    assert load_config(overrides=["actor.policy_loss=my_loss"]).actor.policy_loss == "my_loss"
    cfg = load_config(overrides=["actor.kl_loss_type=k3+", "algorithm.kl_penalty=low_var_kl+"])
    assert (cfg.actor.kl_loss_type, cfg.algorithm.kl_penalty) == ("k3+", "low_var_kl+")
    cfg = load_config(overrides=["algorithm.adv_estimator=plugins/adv.py:mine", "rollout.n=1"])
    assert cfg.algorithm.adv_estimator == "plugins/adv.py:mine"
    with pytest.raises(ConfigError, match=r"actor\.kl_loss_type='full'"):
        load_config(overrides=["actor.kl_loss_type=full"])


def test_static_choices_match_the_modules_that_read_them() -> None:
    """CHOICES entries equal the constants of the modules that consume those keys."""
    from creditrl.data.dataset import OVERLONG_MODES
    from creditrl.models.loading import _DTYPES as MODEL_DTYPES
    from creditrl.tools.output import TRUNCATE_SIDES
    from creditrl.tracking.sinks import LOGGERS
    from creditrl.workers.parallel import _DTYPES as FSDP_DTYPES

    assert set(CHOICES["model.dtype"]) == set(MODEL_DTYPES)
    assert set(CHOICES["trainer.fsdp_param_dtype"]) == set(FSDP_DTYPES)
    assert set(CHOICES["trainer.logger"]) == set(LOGGERS)
    assert set(CHOICES["data.overlong_prompt"]) == set(OVERLONG_MODES)
    assert set(CHOICES["agent.truncate_side"]) == set(TRUNCATE_SIDES)


RANGE_REFUSALS = [
    "actor.grad_clip=0",
    "critic.grad_clip=-1",
    "actor.ppo_epochs=0",
    "critic.ppo_epochs=0",
    "data.train_batch_size=0",
    "actor.ppo_mini_batch_size=0",
    "actor.ppo_micro_batch_size=0",
    "actor.log_prob_micro_batch_size=0",
    "critic.ppo_micro_batch_size=0",
    "rollout.micro_batch_size=0",
    "actor.optim.lr=-1e-6",
    "critic.optim.lr=-1",
    "rollout.temperature=0",
    "rollout.val_temperature=-0.5",
    "rollout.top_p=0",
    "rollout.top_p=1.5",
    "rollout.top_k=0",
    "rollout.top_k=-2",
    "actor.clip_ratio=-0.1",
    "actor.clip_ratio_low=-0.2",
    "actor.clip_ratio_high=-0.2",
    "actor.clip_ratio_c=1",
    "algorithm.rollout_is.threshold=0",
    "algorithm.rollout_is.threshold_lower=0",
    "algorithm.rollout_is.veto_threshold=0",
    "rollout.n=0",
    "rollout.max_response_length=0",
    "data.max_prompt_length=0",
    "reward.max_failure_rate=1.5",
    "reward.timeout_s=0",
    "algorithm.gamma=1.1",
    "algorithm.lam=-0.1",
    "algorithm.kl_ctrl.kl_coef=-0.1",
    "actor.kl_loss_coef=-1",
    "trainer.total_steps=0",
    "trainer.workers=0",
    "trainer.save_freq=-1",
    "trainer.test_freq=-1",
    "actor.optim.warmup_steps=-1",
    "actor.optim.min_lr_ratio=2",
    "actor.optim.betas=[0.9]",
    "critic.optim.betas=[0.9,1.0]",
    "asynchronous.port=70000",
    "asynchronous.dist_port=-1",
    "asynchronous.max_rejects=-1",
    "asynchronous.max_message_mb=-1",
    "asynchronous.publish_every=0",
    "actor.entropy_coeff=.nan",
    "actor.entropy_coeff=.inf",
    "reward.fallback_score=-.inf",
    "agent.max_turns=0",
    "rollout.gpu_memory_utilization=1.5",
]


@pytest.mark.parametrize("override", RANGE_REFUSALS)
def test_numbers_out_of_range_are_refused(capsys, override: str) -> None:
    """Each numeric setting outside its range is one line naming key and allowed range."""
    key = override.split("=", 1)[0]
    line = refused(capsys, override)
    assert f"{key}=" in line and ("must be" in line or "finite" in line)


def _bad_values() -> list[tuple[str, str]]:
    """(key, value outside its choices or range) for every schema field that declares one."""
    out = []
    for key, f, default in schema_fields():
        allowed = f.metadata.get("range")
        if "choices" in f.metadata or "registry" in f.metadata:
            out.append((key, "[not-a-choice]" if isinstance(default, list) else "not-a-choice"))
        elif allowed is not None:
            if allowed.low is not None:
                out.append((key, str(allowed.low if allowed.low_open else allowed.low - 1)))
            if allowed.high is not None:
                out.append((key, str(allowed.high if allowed.high_open else allowed.high + 1)))
    return out


@pytest.mark.parametrize("key,value", _bad_values())
def test_every_declared_field_refuses_a_bad_value(capsys, key: str, value: str) -> None:
    """Each field with choices or a range in the schema's metadata refuses a value outside
    them with one line naming the key."""
    line = refused(capsys, f"{key}={value}")
    assert key in line and ("is not one of" in line or "must be" in line), line


def test_field_metadata_is_walked() -> None:
    """The walk finds the choice and range fields (nested sections and both optims too)."""
    keys = {key for key, _ in _bad_values()}
    assert {"actor.optim.lr", "critic.optim.lr_scheduler", "trainer.logger"} <= keys
    assert {"algorithm.rollout_is.threshold", "asynchronous.max_rejects"} <= keys
    assert len(keys) > 100


def test_max_rejects_zero_never_disconnects_and_loads() -> None:
    """asynchronous.max_rejects=0 (never disconnect) loads in both modes and passes the async
    checks; a negative count is refused."""
    from creditrl.asynchronous.settings import check_async_config

    loaded = load_config_with_sources(overrides=["asynchronous.max_rejects=0"], mode="async")
    assert loaded.config.asynchronous.max_rejects == 0
    check_async_config(loaded.config)
    assert load_config(overrides=["asynchronous.max_rejects=0"]).asynchronous.max_rejects == 0
    with pytest.raises(ConfigError, match=r"asynchronous\.max_rejects=-1 must be >= 0"):
        load_config(overrides=["asynchronous.max_rejects=-1"], mode="async")


def test_grad_clip_zero_names_the_off_switch() -> None:
    """grad_clip=0 (which froze the weights) is refused and points at null; null loads."""
    with pytest.raises(ConfigError, match=r"actor\.grad_clip=0 must be > 0 \(or null"):
        load_config(overrides=["actor.grad_clip=0"])
    cfg = load_config(overrides=["actor.grad_clip=null", "critic.grad_clip=null"])
    assert cfg.actor.grad_clip is None and cfg.critic.grad_clip is None


def test_grad_clip_null_means_no_clipping(monkeypatch) -> None:
    """Actor and critic workers pass max_norm=inf when grad_clip is None, and still step."""
    from creditrl.workers import ActorWorker, CriticWorker

    seen: list[float] = []
    clip = torch.nn.utils.clip_grad_norm_

    def spy(params, max_norm, *args, **kwargs):
        seen.append(max_norm)
        return clip(params, max_norm, *args, **kwargs)

    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", spy)
    model = tiny_lm()
    cfg = ActorConfig(optim=OptimConfig(lr=1e-2), grad_clip=None, autocast="none", shuffle=False)
    metrics = ActorWorker(model, cfg).update_policy(padded_actor_batch(model), 1.0, n_per_prompt=1)
    assert 0 < metrics["actor/grad_norm"] < math.inf
    batch = padded_batch([6, 2, 4], [5, 1, 3])
    critic = CriticWorker(TinyCritic(), CriticConfig(ppo_mini_batch_size=3, grad_clip=None))
    batch["values"] = critic.compute_values(batch)
    batch["returns"] = batch["values"] + 1.0
    assert critic.update_critic(batch, n_per_prompt=1)["critic/grad_norm"] > 0
    assert seen == [math.inf, math.inf]


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["rollout.n=1"], "rollout.n=1 gives every advantage 0"),
        (["algorithm.adv_estimator=rloo", "rollout.n=1"], "algorithm.adv_estimator=rloo"),
        (["preset=dapo", "rollout.n=1"], "rollout.n=1"),
        (["data.train_batch_size=2"], "actor.ppo_mini_batch_size=4 is larger than"),
        (["actor.ppo_mini_batch_size=3"], "data.train_batch_size=4 is not a multiple"),
        (["preset=ppo", "critic.ppo_mini_batch_size=8"], "critic.ppo_mini_batch_size=8"),
        (["trainer.workers=2"], "needs trainer.backend=ray"),
        (
            ["trainer.backend=ray", "trainer.workers=3"],
            "actor.ppo_mini_batch_size x rollout.n = 16 trajectories",
        ),
        (["algorithm.rollout_is.threshold_lower=3"], "threshold_lower=3 must be <="),
        (
            ["algorithm.overlong_buffer.enable=true", "algorithm.overlong_buffer.len=200"],
            "algorithm.overlong_buffer.len=200",
        ),
        (["rollout.engine=vllm", "model.lora_rank=8"], "model.lora_rank"),
        (["data.task=null"], "data.task"),
    ],
)
def test_degenerate_combinations_are_refused(capsys, overrides: list, message: str) -> None:
    """Combinations that cannot train (groups of one, mini-batch > batch, ...) are refused."""
    assert message in refused(capsys, *overrides)


def test_combinations_that_train_are_accepted() -> None:
    """Estimators without groups take rollout.n=1; the critic's mini-batch is only checked
    when a critic runs."""
    for estimator in ("gae", "reinforce_plus_plus", "remax"):
        load_config(overrides=[f"algorithm.adv_estimator={estimator}", "rollout.n=1"])
    load_config(overrides=["preset=ppo"])
    load_config(overrides=["critic.ppo_mini_batch_size=8"])


def test_model_path_must_exist(capsys, tmp_path: Path) -> None:
    """model.path is 'embedded' or an existing directory; anything else is one line."""
    line = refused(capsys, f"model.path={tmp_path / 'missing'}")
    assert "model.path=" in line and "missing" in line
    assert load_config(overrides=[f"model.path={tmp_path}"]).model.path == str(tmp_path)
    line = refused(capsys, "reward.reward_model.enable=true")
    assert "reward.reward_model.path" in line


@pytest.mark.parametrize(
    "overrides,warning",
    [
        (
            ["critic.optim.lr=1e-5"],
            "critic.optim.lr=1e-05 is set but algorithm.adv_estimator=grpo uses no critic",
        ),
        (["agent.max_turns=3"], "agent.max_turns=3 is set but agent.enable=false"),
        (
            ["algorithm.kl_ctrl.kl_coef=0.1"],
            "algorithm.kl_ctrl.kl_coef=0.1 is set but algorithm.use_kl_in_reward=false",
        ),
        (
            ["actor.kl_loss_coef=0.1", "actor.kl_loss_type=k1"],
            "actor.kl_loss_coef=0.1, actor.kl_loss_type='k1' are set but actor.use_kl_loss=false",
        ),
        (
            ["algorithm.rollout_is.threshold=3"],
            "algorithm.rollout_is.threshold=3 is set but algorithm.rollout_is.enable=false",
        ),
        (
            ["algorithm.filter_groups.max_num_gen_batches=8"],
            "max_num_gen_batches=8 is set but algorithm.filter_groups.enable=false",
        ),
        (
            ["algorithm.overlong_buffer.len=8"],
            "algorithm.overlong_buffer.len=8 is set but algorithm.overlong_buffer.enable=false",
        ),
        (
            ["rollout.gpu_memory_utilization=0.9"],
            "rollout.gpu_memory_utilization=0.9 is set but rollout.engine=hf",
        ),
        (
            ["trainer.ray.cpus_per_worker=2"],
            "trainer.ray.cpus_per_worker=2 is set but trainer.backend=local",
        ),
    ],
)
def test_unused_settings_warn(capsys, overrides: list, warning: str) -> None:
    """A key the user set that the chosen mode will not use is one yellow warning line; the
    command still succeeds."""
    assert warning in load_config_with_sources(overrides=overrides).warnings[0]
    assert main(["config", *overrides]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("warning: ") and warning in lines[0]


def test_defaults_and_presets_warn_about_nothing(tmp_path: Path) -> None:
    """No warnings for the defaults or any preset; keys that are used do not warn; a file's
    keys count as set by the user."""
    assert load_config_with_sources().warnings == []
    for name in PRESETS:
        assert load_config_with_sources(preset=name).warnings == [], name
    used = load_config_with_sources(
        overrides=["preset=ppo", "critic.optim.lr=1e-5", "algorithm.kl_ctrl.kl_coef=0.1"]
    )
    assert used.warnings == []
    assert {"critic.optim.lr", "algorithm.kl_ctrl.kl_coef", "rollout.n"} <= used.explicit
    path = tmp_path / "run.yaml"
    path.write_text("agent:\n  max_turns: 2\n")
    assert load_config_with_sources(path).warnings == [
        "agent.max_turns=2 is set but agent.enable=false"
    ]


@pytest.mark.parametrize(
    "override,message",
    [
        ("actor.optim.lr=abc", "actor.optim.lr: 'abc' is not a float"),
        ("rollout.n=1.5", "rollout.n: 1.5 is not an integer"),
        ("rollout.n=", "rollout.n: null is not an integer"),
        ("actor.use_kl_loss=maybe", "actor.use_kl_loss: 'maybe' is not true or false"),
        ("rollout=5", "'rollout' is a section, not a value"),
        ("algorithm.rollout_is=true", "algorithm.rollout_is.enable="),
        ("rollout.n.x=1", "'rollout.n' is a setting, not a section"),
        ("actor.optim.lr=[1,", "override 'actor.optim.lr=[1,': cannot read the value"),
        ("=5", "override '=5'"),
        ("a..b=1", "override 'a..b=1'"),
        ("+trainer.total_steps=3", "not a dotted key"),
        ("rollout.n", "is not of the form key=value"),
    ],
)
def test_override_mistakes_are_one_line(capsys, override: str, message: str) -> None:
    """Malformed overrides, sections given values and wrong types: one line each."""
    assert message in refused(capsys, "trainer.total_steps=3", override)


@pytest.mark.parametrize(
    "text,message",
    [
        ("- rollout\n- actor\n", "is not a mapping of config keys (its top level is a list)"),
        ("5\n", "is not a mapping of config keys (its top level is the value 5)"),
        ("rollout:\n  n: [1,\ntrainer:\n  total_steps: 3\n", ", line 4: YAML syntax error"),
        ("rollout:\n\tn: 3\n", ", line 2: YAML syntax error"),
        ("rollout:\n  n: 2\nrollout:\n  n: 3\n", "YAML syntax error"),
        ("rollout: 5\n", "'rollout' is a section, not a value (from "),
        ("actor:\n  optim:\n    lr: fast\n", "actor.optim.lr: 'fast' is not a float"),
        (
            "actor_rollout_ref:\n  actor:\n    optim:\n      lr: 1.0e-6\n",
            "creditrl calls it 'actor.optim.lr'",
        ),
    ],
)
def test_yaml_mistakes_name_the_file(capsys, tmp_path: Path, text: str, message: str) -> None:
    """YAML files that are not mappings, do not parse, or hold bad values: one line naming
    the file (and the line for syntax errors)."""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    line = refused(capsys, str(path))
    assert message in line and str(path) in line


VERL_KEYS = [
    ("actor_rollout_ref.actor.optim.lr=1e-6", "actor.optim.lr"),
    ("data.max_response_length=64", "rollout.max_response_length"),
    ("actor_rollout_ref.rollout.n=4", "rollout.n"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor.ppo_mini_batch_size"),
    ("trainer.total_training_steps=10", "trainer.total_steps"),
    ("actor_rollout_ref.rollout.temperature=1.0", "rollout.temperature"),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor.ppo_micro_batch_size"),
    ("critic.ppo_micro_batch_size_per_gpu=2", "critic.ppo_micro_batch_size"),
    ("actor_rollout_ref.actor.kl_loss_type=k3", "actor.kl_loss_type"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode=gspo", "actor.policy_loss"),
    ("actor_rollout_ref.model.path=x", "model.path"),
    ("reward_model.overlong_buffer.len=8", "algorithm.overlong_buffer.len"),
    ("algorithm.rollout_correction.threshold=2", "algorithm.rollout_is.threshold"),
    ("actor_rollout_ref.rollout.name=vllm", "rollout.engine"),
]


@pytest.mark.parametrize("override,ours", VERL_KEYS)
def test_verl_names_point_to_creditrl_names(capsys, override: str, ours: str) -> None:
    """verl's key names are answered with creditrl's key, not the nearest spelling."""
    key = override.split("=", 1)[0]
    line = refused(capsys, override)
    assert f"unknown key '{key}' (verl's name" in line and f"creditrl calls it '{ours}'" in line


def test_verl_map_targets_exist() -> None:
    """Every creditrl name in the verl map is a key of the schema."""
    keys = set(all_keys())
    assert not [ours for ours in VERL_NAMES.values() if ours not in keys]


def test_one_value_for_a_list_key_is_a_one_item_list(tmp_path: Path) -> None:
    """data.train_files=file.jsonl (no brackets) and the same in YAML are one-file lists."""
    cfg = load_config(
        overrides=[
            "data.train_files=rows.jsonl",
            "data.val_files=val.jsonl",
            "agent.tools=calculator",
            "agent.stop=</answer>",
            "trainer.logger=jsonl",
        ]
    )
    assert cfg.data.train_files == ["rows.jsonl"] and cfg.data.val_files == ["val.jsonl"]
    assert cfg.agent.tools == ["calculator"] and cfg.agent.stop == ["</answer>"]
    assert cfg.trainer.logger == ["jsonl"]
    path = tmp_path / "run.yaml"
    path.write_text("data:\n  train_files: a.parquet\n")
    assert load_config(path).data.train_files == ["a.parquet"]


def test_async_mode_defaults_to_sequence_mean_aggregation(tmp_path: Path) -> None:
    """mode="async" starts from loss_agg_mode=seq-mean-token-mean (spec 003), under the
    preset, file and overrides; sync keeps token-mean; the default is not a user setting."""
    loaded = load_config_with_sources(mode="async")
    assert loaded.config.actor.loss_agg_mode == "seq-mean-token-mean"
    assert "actor.loss_agg_mode" not in loaded.explicit
    assert load_config().actor.loss_agg_mode == "token-mean"
    over = load_config(overrides=["actor.loss_agg_mode=token-sum"], mode="async")
    assert over.actor.loss_agg_mode == "token-sum"
    assert load_config(preset="grpo", mode="async").actor.loss_agg_mode == "token-mean"
    assert load_config(mode="async").critic.loss_agg_mode == "token-mean"
    with pytest.raises(ValueError, match="mode"):
        load_config(mode="batch")


def test_describe_sizes_uses_the_real_mini_batch() -> None:
    """A mini-batch larger than the batch is described as the whole batch (8 trajectories,
    not 16); load_config refuses that combination."""
    cfg = Config(data=DataConfig(train_batch_size=2), actor=ActorConfig(ppo_mini_batch_size=4))
    text = describe_sizes(cfg)
    assert "2 prompts x rollout.n 4 = 8 trajectories" in text
    assert "1 optimizer step(s) of 8 trajectories" in text
    with pytest.raises(ConfigError, match="ppo_mini_batch_size=4 is larger"):
        load_config(overrides=["data.train_batch_size=2"])
    ok = describe_sizes(load_config(overrides=["actor.ppo_mini_batch_size=2"]))
    assert "2 optimizer step(s) of 8 trajectories" in ok


def test_user_errors_from_the_trainer_are_one_line(capsys, monkeypatch) -> None:
    """A UserError raised while building the trainer prints one red line, exit code 2."""
    import creditrl.trainers.rl_trainer as rl_trainer

    def broken(cfg, console=None):
        raise DataError("data.train_files: rows.jsonl row 3 has no 'prompt' [see docs]")

    monkeypatch.setattr(rl_trainer, "RLTrainer", broken)
    assert main(["train", "trainer.total_steps=1"]) == 2
    out = capsys.readouterr().out
    assert "error: data.train_files: rows.jsonl row 3 has no 'prompt' [see docs]" in out
    assert "Traceback" not in out and len(out.strip().splitlines()) == 2  # sizes, then error


@pytest.mark.parametrize(
    "override,named",
    [
        ("algorithm.lam=0.9", "has no lambda"),
        ("algorithm.gamma=0.9", "does not discount"),
        ("algorithm.norm_adv_by_std_in_grpo=false preset=rloo", "no group std"),
        ("actor.clip_ratio_c=2.0 actor.policy_loss=gspo", "no dual clip"),
        ("actor.tau_pos=2.0", "is not sapo"),
        ("actor.loss_scale_factor=96", "divides by no constant"),
        ("reward.async_reward=true preset=dapo", "cannot overlap"),
        ("actor.max_token_len_per_device=1024 actor.use_dynamic_bsz=false", "bsz=false"),
    ],
)
def test_settings_an_estimator_or_loss_ignores_warn(override: str, named: str) -> None:
    """Options that were silent no-ops for the chosen estimator, loss or mode: each now gets
    a warning naming the key and why it is unused."""
    from creditrl.config.loader import load_config_with_sources

    loaded = load_config_with_sources(None, override.split())
    assert any(named in line for line in loaded.warnings), loaded.warnings
    key = override.split()[0].split("=")[0]
    assert any(key in line for line in loaded.warnings)


def test_greedy_validation_with_several_samples_is_refused() -> None:
    """val_n > 1 at val_temperature 0 gave val_n identical answers (pass@k == mean@1)."""
    from creditrl.config.loader import load_config
    from creditrl.errors import ConfigError

    with pytest.raises(ConfigError, match=r"rollout\.val_n=4 with rollout\.val_temperature=0"):
        load_config(None, ["rollout.val_n=4"])
