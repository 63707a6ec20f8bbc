"""``creditrl eval [CONFIG.yaml | MODEL] [key=value ...]``: validation metrics of one model;
``creditrl eval --compare A B [CONFIG.yaml] [key=value ...]``: two models on the same prompts
with the same seeds, and the difference per metric.

A model is ``embedded``, a Hugging Face model directory (an export), a run directory (its
newest complete checkpoint) or ``RUN/checkpoints/step_NNNNNN``; ``model.path=`` names it too.
The config is CONFIG.yaml, else the config.yaml of the (first) run given, else the defaults.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from creditrl.errors import UserError
from creditrl.plain_text import as_text


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _describe(spec: str, target: Any) -> str:
    from creditrl.exporting.sources import RunCheckpoint

    if isinstance(target, RunCheckpoint):
        return f"{spec} (checkpoint {target.directory}, step {target.step})"
    return spec


def _evaluate(args: argparse.Namespace, console: Console) -> list[dict[str, float]]:
    from creditrl.console import print_warning
    from creditrl.exporting.evaluate import evaluated_model, plan_eval, validation_metrics

    plan = plan_eval(args.args, args.compare, trust_run_code=args.trust_run_code)
    for line in plan.warnings:
        print_warning(console, line)
    console.print(as_text(f"config: {plan.config_file or 'the defaults'}"), soft_wrap=True)
    results = []
    for label, spec, target in zip("AB", plan.specs, plan.targets, strict=False):
        name = f"{label}: " if args.compare else ""
        console.print(as_text(f"{name}evaluating {_describe(spec, target)}"), soft_wrap=True)
        for line in getattr(target, "skipped", ()):
            print_warning(console, f"checkpoint {line} is damaged; evaluating an older one")
        with evaluated_model(target, plan.trust_run_code) as model_dir:
            results.append(validation_metrics(plan.config_for(model_dir)))
    return results


def run(args: argparse.Namespace, console: Console) -> int:
    """Handle ``creditrl eval``."""
    from creditrl.console import print_error

    try:
        results = _evaluate(args, console)
    except UserError as err:
        print_error(console, err)
        return 2
    if not args.compare:
        for key, value in sorted(results[0].items()):
            console.print(as_text(f"{key}: {value:.4f}"), soft_wrap=True)
        return 0
    a, b = results
    console.print("metric: A -> B (B - A)")
    for key in sorted(set(a) | set(b)):
        diff = f" ({b[key] - a[key]:+.4f})" if key in a and key in b else ""
        line = f"{key}: {_number(a.get(key))} -> {_number(b.get(key))}{diff}"
        console.print(as_text(line), soft_wrap=True)
    return 0


def register(sub: Any) -> None:
    """Add ``eval`` to the CLI."""
    from creditrl.config.run_config import TRUST_FLAG, TRUST_HELP

    cmd = sub.add_parser(
        "eval",
        help="validation metrics of a model, run or checkpoint; --compare A B for two",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cmd.add_argument("args", nargs="*", help="[CONFIG.yaml | MODEL] [key=value ...]")
    cmd.add_argument(
        "--compare",
        nargs=2,
        metavar=("A", "B"),
        help="two models, runs or checkpoints: both metrics and B - A per metric",
    )
    cmd.add_argument(TRUST_FLAG, action="store_true", help=TRUST_HELP)
    cmd.set_defaults(handler=run)
