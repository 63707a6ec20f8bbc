"""The user's view of a run: metric sinks, verl-named metrics, the progress bar and rollout
dumps."""

from creditrl.tracking.metrics import (
    Timer,
    compute_data_metrics,
    compute_throughput_metrics,
    compute_timing_metrics,
    reduce_metrics,
    response_info,
    timer,
)
from creditrl.tracking.progress import TrainingProgress, print_summary, reward_trend
from creditrl.tracking.rollout_dump import PER_TOKEN_FIELDS, RolloutDumper, load_rollout_dump
from creditrl.tracking.sinks import LOGGERS, Tracker, truncate_jsonl

__all__ = [
    "LOGGERS",
    "PER_TOKEN_FIELDS",
    "RolloutDumper",
    "Timer",
    "Tracker",
    "TrainingProgress",
    "compute_data_metrics",
    "compute_throughput_metrics",
    "compute_timing_metrics",
    "load_rollout_dump",
    "print_summary",
    "reduce_metrics",
    "response_info",
    "reward_trend",
    "timer",
    "truncate_jsonl",
]
