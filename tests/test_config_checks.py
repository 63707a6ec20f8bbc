"""The checks that need a registry's declarations live with the registry and register with
``creditrl.config.checks``; ``validate_config`` runs them all, in order, even when only
``creditrl.config`` was imported."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from creditrl.config import Config, validate_config
from creditrl.config.checks import (
    _CHECKS,
    CHECK_ORDER,
    config_checks,
    register_config_check,
    unused_rules,
)
from creditrl.errors import ConfigError


def _cfg(**changes: object) -> Config:
    cfg = Config()
    cfg.model.path = "embedded"
    cfg.data.task = "basic_arithmetic"
    for key, value in changes.items():
        section, _, name = key.partition("__")
        setattr(getattr(cfg, section), name, value)
    return cfg


def test_a_config_is_checked_by_the_registries_without_torch() -> None:
    """A fresh process that imports ``creditrl.config`` loads the registries and their checks
    (``creditrl.catalog``: light) but no torch, transformers or tensordict, and
    ``validate_config`` refuses what only a registry's check knows (the estimator declares
    groups)."""
    code = textwrap.dedent(
        """
        import sys
        from creditrl.config import Config, validate_config
        from creditrl.errors import ConfigError
        cfg = Config()
        cfg.model.path, cfg.data.task, cfg.rollout.n = "embedded", "basic_arithmetic", 1
        try:
            validate_config(cfg)
        except ConfigError as err:
            print("refused", err)
        heavy = sorted(m for m in ("torch", "transformers", "tensordict") if m in sys.modules)
        print("heavy", heavy)
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    ).stdout
    assert "heavy []" in out
    assert "refused algorithm.adv_estimator=grpo compares the rollout.n answers" in out


def test_every_owner_registers_its_checks_in_order() -> None:
    assert len(config_checks()) == len(_CHECKS)
    assert set(CHECK_ORDER) == set(_CHECKS)  # every check of the package has its place
    names = list(CHECK_ORDER)
    assert {"endpoint_host", "critic_batches", "estimator_groups", "engine_lora"} <= set(names)
    assert {"static_decode_cache", "sample_dtype_bf16", "distill", "paths"} <= set(names)
    assert names.index("endpoint_host") < names.index("actor_batches") < names.index("paths")
    assert names[-1] == "distill"
    assert len(unused_rules()) >= 30


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"agent__endpoint_host": "0.0.0.0"}, "agent.endpoint_host='0.0.0.0' is not a loopback"),
        ({"rollout__n": 1}, "algorithm.adv_estimator=grpo compares the rollout.n answers"),
    ],
)
def test_registered_checks_refuse_with_their_messages(
    changes: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        validate_config(_cfg(**changes))


def test_a_check_registered_by_user_code_runs() -> None:
    calls = []

    @register_config_check("test_user_check")
    def _seen(cfg: Config) -> None:
        calls.append(cfg.data.task)

    try:
        validate_config(_cfg())
        assert calls == ["basic_arithmetic"]
    finally:
        del _CHECKS["test_user_check"]
