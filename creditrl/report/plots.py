"""Which plots a run report holds, and the metric series of each (verl's metric names).

A series is *required* when every training run logs it; an optional one is drawn when the run
logged it (e.g. ``val/score`` needs ``trainer.test_freq > 0``, ``actor/reward_kl_penalty``
needs KL in the reward). A key ending in ``/*`` stands for every metric under that prefix.
A required series (or a required prefix) with no point is reported as missing.
"""

from __future__ import annotations

from dataclasses import dataclass

from creditrl.report.metrics_log import MetricsLog
from creditrl.report.svg import Series

__all__ = ["PLOTS", "PlotData", "PlotSpec", "SeriesSpec", "plot_data"]


@dataclass(frozen=True)
class SeriesSpec:
    key: str
    label: str
    required: bool = True
    needs: str = ""  # what an optional series needs, shown when it is absent


@dataclass(frozen=True)
class PlotSpec:
    id: str
    title: str
    y_label: str
    series: tuple[SeriesSpec, ...]


# fmt: off
PLOTS: tuple[PlotSpec, ...] = (
    PlotSpec("reward", "Reward and validation score", "score", (
        SeriesSpec("critic/score/mean", "train score (mean)"),
        SeriesSpec("critic/rewards/mean", "train reward incl. KL (mean)"),
        SeriesSpec("val/score", "validation score", False, "trainer.test_freq > 0"),
    )),
    PlotSpec("kl", "KL", "nats / token", (
        SeriesSpec("actor/ppo_kl", "ppo_kl (π_old vs π_θ)"),
        SeriesSpec("actor/reward_kl_penalty", "KL in the reward", False,
                   "algorithm.use_kl_in_reward"),
        SeriesSpec("actor/kl_loss", "KL loss", False, "actor.use_kl_loss"),
    )),
    PlotSpec("entropy", "Entropy", "nats / token", (
        SeriesSpec("actor/entropy", "policy entropy"),
    )),
    PlotSpec("response_length", "Response length", "tokens", (
        SeriesSpec("response_length/mean", "mean"),
        SeriesSpec("response_length/max", "max"),
        SeriesSpec("response_length/min", "min"),
    )),
    PlotSpec("clip_ratio", "Response clip ratio (hit max length)", "fraction", (
        SeriesSpec("response_length/clip_ratio", "clip_ratio"),
    )),
    PlotSpec("pg_clipfrac", "Policy clip fraction", "fraction of tokens", (
        SeriesSpec("actor/pg_clipfrac", "pg_clipfrac"),
        SeriesSpec("actor/pg_clipfrac_lower", "pg_clipfrac_lower (dual clip)"),
        SeriesSpec("critic/vf_clipfrac", "vf_clipfrac", False, "a critic (GAE)"),
    )),
    PlotSpec("grad_norm", "Gradient norm (before clipping)", "L2 norm", (
        SeriesSpec("actor/grad_norm", "actor"),
        SeriesSpec("critic/grad_norm", "critic", False, "a critic (GAE)"),
    )),
    PlotSpec("timing", "Time per stage", "seconds", (
        SeriesSpec("timing_s/*", "timing_s"),
    )),
    PlotSpec("throughput", "Throughput", "tokens / s", (
        SeriesSpec("perf/throughput", "perf/throughput"),
    )),
)
# fmt: on


@dataclass
class PlotData:
    """A plot's series as logged, what is missing and which optional series are absent."""

    spec: PlotSpec
    series: list[Series]
    missing: list[str]
    absent: list[str]


def plot_data(spec: PlotSpec, log: MetricsLog) -> PlotData:
    """The series of ``spec`` from ``log``."""
    keys = log.keys()
    series: list[Series] = []
    missing: list[str] = []
    absent: list[str] = []
    for s in spec.series:
        if s.key.endswith("/*"):
            prefix = s.key[:-1]
            matched = [k for k in keys if k.startswith(prefix)]
            names = [(k, k.removeprefix(prefix)) for k in matched]
        else:
            names = [(s.key, s.label)] if s.key in keys else []
        for key, label in names:
            steps, values = log.series(key)
            series.append(Series(label, steps, values))
        known = [x for x in series[len(series) - len(names) :] if x.points()]
        if not known:
            if s.required:
                missing.append(s.key)
            else:
                absent.append(f"{s.label} ({s.key}; needs {s.needs})")
    return PlotData(spec, series, missing, absent)
