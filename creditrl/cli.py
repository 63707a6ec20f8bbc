"""The ``creditrl`` command: train, config, eval, and the subcommands in ``creditrl.commands``."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from rich.console import Console

from creditrl.commands import SUBCOMMANDS
from creditrl.config import Config
from creditrl.config.loader import ConfigError, load_config, to_dict


def describe_sizes(cfg: Config) -> str:
    """The resolved batch sizes, each with its unit."""
    n = cfg.rollout.n
    per_step = cfg.data.train_batch_size * n
    mini = cfg.actor.ppo_mini_batch_size * n
    return (
        f"step: {cfg.data.train_batch_size} prompts x rollout.n {n} = {per_step} trajectories; "
        f"actor update: {-(-cfg.data.train_batch_size // cfg.actor.ppo_mini_batch_size)} "
        f"optimizer step(s) of {mini} trajectories x {cfg.actor.ppo_epochs} epoch(s), "
        f"micro-batches of {cfg.actor.ppo_micro_batch_size} trajectories"
    )


def _split_args(items: list[str]) -> tuple[Path | None, list[str]]:
    """[CONFIG] [overrides...]: the first item is a config file unless it holds '='."""
    if items and "=" not in items[0]:
        return Path(items[0]), items[1:]
    return None, items


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    parser = argparse.ArgumentParser(prog="creditrl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in [
        ("train", "train (the default: GRPO on SmolLM2-135M-Instruct, chain_sum)"),
        ("run", "alias of train"),
        ("config", "print the resolved config"),
        ("eval", "validation only"),
    ]:
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("args", nargs="*", help="[CONFIG.yaml] [key=value ...]")
    for module in SUBCOMMANDS:
        importlib.import_module(module).register(sub)
    args = parser.parse_args(argv)
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    if getattr(args, "handler", None) is not None:
        return int(args.handler(args, console))
    config_file, overrides = _split_args(args.args)
    try:
        cfg = load_config(config_file, overrides)
    except ConfigError as err:
        console.print(f"[red]config error:[/red] {err}")
        return 2
    if args.command == "config":
        from omegaconf import OmegaConf

        console.print(OmegaConf.to_yaml(to_dict(cfg)), markup=False)
        console.print(describe_sizes(cfg))
        return 0
    from creditrl.tracking import print_summary
    from creditrl.trainers.rl_trainer import RLTrainer

    console.print(describe_sizes(cfg))
    trainer = RLTrainer(cfg, console=console)
    if args.command == "eval":
        metrics = trainer.validate()
        for key, value in sorted(metrics.items()):
            console.print(f"{key}: {value:.4f}")
        return 0
    from creditrl.controller.ray_group import WorkerError

    try:
        summary = trainer.fit()
    except WorkerError as err:
        console.print(f"[red]worker error:[/red] {err}", markup=True)
        console.print(
            f"the run stopped; rerun the same command to resume from the last checkpoint in "
            f"{cfg.trainer.output_dir}/checkpoints"
        )
        return 1
    print_summary(console, summary.as_dict())
    return 0


if __name__ == "__main__":
    sys.exit(main())
