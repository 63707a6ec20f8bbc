"""Config: defaults, presets, YAML files, overrides, and errors that suggest the right key."""

import pytest

from creditrl.cli import describe_sizes
from creditrl.config.loader import PRESETS, ConfigError, all_keys, load_config


def test_defaults_and_overrides_are_typed() -> None:
    cfg = load_config(
        overrides=["rollout.n=8", "actor.optim.lr=3e-6", "data.task_kwargs.min_terms=3"]
    )
    assert cfg.rollout.n == 8 and isinstance(cfg.rollout.n, int)
    assert cfg.actor.optim.lr == pytest.approx(3e-6)
    assert cfg.data.task_kwargs["min_terms"] == 3 and cfg.data.task_kwargs["max_digits"] == 1
    assert cfg.algorithm.adv_estimator == "grpo"


def test_every_preset_loads(tmp_path) -> None:
    assert {"grpo", "ppo", "dapo", "gspo", "rloo", "reinforce_plus_plus"} <= set(PRESETS)
    for name in PRESETS:
        load_config(preset=name)
    assert load_config(preset="ppo").algorithm.adv_estimator == "gae"
    assert load_config(preset="gspo").actor.policy_loss == "gspo"
    assert load_config(preset="dapo").actor.clip_ratio_high == pytest.approx(0.28)


def test_yaml_file_with_preset_and_override_order(tmp_path) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("preset: ppo\nrollout:\n  n: 3\ntrainer:\n  total_steps: 7\n")
    cfg = load_config(path, ["trainer.total_steps=9"])
    assert cfg.algorithm.adv_estimator == "gae"  # from the preset
    assert cfg.rollout.n == 3  # the file wins over the preset
    assert cfg.trainer.total_steps == 9  # the override wins over the file


@pytest.mark.parametrize(
    "override,suggestion",
    [
        ("rollout.temprature=0.5", "rollout.temperature"),
        ("actor.lr=1e-5", "actor.optim.lr"),
        ("data.train_batchsize=4", "data.train_batch_size"),
    ],
)
def test_unknown_keys_suggest_the_right_one(override: str, suggestion: str) -> None:
    with pytest.raises(ConfigError, match=f"did you mean '{suggestion}'"):
        load_config(overrides=[override])


def test_bad_values_and_forms_are_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"rollout\.n"):
        load_config(overrides=["rollout.n=many"])
    with pytest.raises(ConfigError, match="key=value"):
        load_config(overrides=["rollout.n"])
    with pytest.raises(ConfigError, match="unknown preset"):
        load_config(preset="nope")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("trainer:\n  totl_steps: 3\n")
    with pytest.raises(ConfigError, match=r"trainer\.total_steps"):
        load_config(bad)


def test_sizes_state_their_units() -> None:
    text = describe_sizes(load_config(overrides=["data.train_batch_size=4", "rollout.n=4"]))
    assert "4 prompts x rollout.n 4 = 16 trajectories" in text
    assert "trainer.total_steps" in all_keys() and "actor.optim.lr" in all_keys()


def test_an_override_setting_a_mapping_whole_replaces_it() -> None:
    """Another task's arguments must not inherit chain_sum's defaults: `data.task_kwargs={...}`
    replaces the mapping, `data.task_kwargs.name=value` sets one entry of it."""
    whole = load_config(overrides=["data.task=word_sorting", "data.task_kwargs={max_words: 5}"])
    assert whole.data.task_kwargs == {"max_words": 5}
    assert load_config(overrides=["data.task_kwargs={}"]).data.task_kwargs == {}
    one = load_config(overrides=["data.task_kwargs.max_terms=3"]).data.task_kwargs
    assert one == {"min_terms": 2, "max_terms": 3, "min_digits": 1, "max_digits": 1}
    later = load_config(overrides=["data.task_kwargs={a: 1}", "data.task_kwargs.b=2"])
    assert later.data.task_kwargs == {"a": 1, "b": 2}
