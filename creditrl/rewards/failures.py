"""The scoring failure limit: a step where too many samples fail to score stops the run.

Below ``reward.max_failure_rate`` failed samples get ``reward.fallback_score`` and are counted
in the metrics; above it the rewards are mostly fallbacks, so training on them is pointless
and the run stops with the first error.
"""

from __future__ import annotations

from collections.abc import Sequence

from creditrl.errors import ConfigError, UserError
from creditrl.usercode import one_line

__all__ = ["ScoringError", "check_failure_rate", "check_max_failure_rate"]


class ScoringError(UserError):
    """More than ``reward.max_failure_rate`` of a step's samples failed to score."""


def check_max_failure_rate(rate: float) -> None:
    """ConfigError unless ``reward.max_failure_rate`` is a share in [0, 1]."""
    if not 0.0 <= rate <= 1.0:
        raise ConfigError(f"reward.max_failure_rate must be in [0, 1], got {rate!r}")


def check_failure_rate(failures: Sequence[str], total: int, max_failure_rate: float) -> None:
    """ScoringError when ``len(failures) / total > max_failure_rate``; ``failures`` describe
    the failed samples in order and the first one is quoted."""
    if not total or len(failures) / total <= max_failure_rate:
        return
    raise ScoringError(
        f"reward: {len(failures)} of {total} samples failed to score "
        f"(max_failure_rate {max_failure_rate:g}); first error: {one_line(failures[0], 500)}"
    )
