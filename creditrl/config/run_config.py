"""A run directory's config (``RUN/config.yaml``) read as data: a run someone sent (an archive,
a shared folder) is exported, evaluated, explained and reported on without running code it
names.

``load_run_config`` checks the file as ``load_config`` does, but imports its
``trainer.extensions`` only when the user passes ``TRUST_FLAG`` (``trust_code=True``). A setting
that only an extension makes valid (a loss, an engine or an option it registers) is then one
line naming the extensions and the flag. ``run_code`` lists the other settings that name code
(``reward.scorer`` or ``algorithm.adv_estimator`` as ``file.py:name``, ``agent.program``,
``env.verifiers``, ``agent.tool_config``), which ``creditrl eval`` would run with the run's config.
The file itself gets a model directory's file checks (``run_files.run_file_text``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from creditrl.config.checks import run_code_finders
from creditrl.config.fields import format_value
from creditrl.config.limits import shorten
from creditrl.config.loader import _read_yaml, load_config_with_sources
from creditrl.config.run_files import run_file_text
from creditrl.config.schema import Config
from creditrl.errors import ConfigError
from creditrl.usercode import is_code_spec

__all__ = ["TRUST_FLAG", "TRUST_HELP", "TRUST_REMEDY", "load_run_config", "run_code"]

TRUST_FLAG = "--trust-run-code"
TRUST_REMEDY = f"pass {TRUST_FLAG} if they register it (they run code)"
TRUST_HELP = (
    "import the trainer.extensions (and, for eval, run the scorer, estimator, program or tools "
    "given as code) that the run's config.yaml names: they run with your rights, so only for "
    "a run you trust (default: the run's config is read as data)"
)


def _extensions(path: Path) -> list[str]:
    """The ``trainer.extensions`` the YAML file at ``path`` names, shortened for a message."""
    try:
        trainer = _read_yaml(path).get("trainer")
    except ConfigError:
        return []
    names = trainer.get("extensions") if isinstance(trainer, dict) else None
    names = [names] if isinstance(names, str) else names
    if not isinstance(names, list):
        return []
    return [shorten(" ".join(str(n).split()), 60) for n in names[:5] if n is not None]


def load_run_config(
    path: str | Path,
    overrides: Sequence[str] = (),
    *,
    trust_code: bool = False,
    remedy: str = TRUST_REMEDY,
) -> Config:
    """The checked config of a run (its ``config.yaml``) with ``overrides`` on top, imported
    code only with ``trust_code``; a one-line ``ConfigError`` naming the file otherwise, which
    says ``remedy`` (what the command reading the run accepts) when a setting only the run's
    extensions make valid is refused."""
    path = Path(path)
    run_file_text(path)  # a regular file inside the run, bounded, before the loader reads it
    try:
        return load_config_with_sources(path, list(overrides), import_code=trust_code).config
    except ConfigError as err:
        names = [] if trust_code else _extensions(path)
        if not names:
            raise
        raise ConfigError(
            f"{path}: {err}; the run's trainer.extensions ({', '.join(names)}) are not "
            f"imported when a run is read: {remedy}"
        ) from None


def run_code(cfg: Config) -> list[str]:
    """``key=value`` of each setting of ``cfg`` that names code to import or run: those here,
    then those the selected rollout strategy runs (registered with ``register_run_code``, by
    ``creditrl.rollout.checks``)."""
    found = []
    if cfg.trainer.extensions:
        found.append(f"trainer.extensions={format_value(cfg.trainer.extensions)}")
    if cfg.reward.scorer is not None and is_code_spec(cfg.reward.scorer):
        found.append(f"reward.scorer={format_value(cfg.reward.scorer)}")
    if is_code_spec(cfg.algorithm.adv_estimator):
        found.append(f"algorithm.adv_estimator={format_value(cfg.algorithm.adv_estimator)}")
    for finder in run_code_finders():
        found.extend(finder(cfg))
    return [shorten(item, 120) for item in found]
