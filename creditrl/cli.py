"""The ``creditrl`` command: train, config, eval, explain."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from creditrl.config import Config
from creditrl.config.loader import ConfigError, load_config, to_dict
from creditrl.inspect.example import BETA, COLUMNS, GAMMA, HEADERS, LAM, spec000_example


def print_example(console: Console) -> None:
    """Print the spec 000 worked example as a per-token table with a legend."""
    data = spec000_example()
    table = Table(
        title=f"spec 000 worked example: 请问1+1=2？ -> 是的，等于2！ (beta={BETA}, "
        f"gamma={GAMMA}, lambda={LAM}, k1 KL in the reward)"
    )
    for name in COLUMNS:
        header = HEADERS.get(name, name)
        table.add_column(header, justify="left" if name == "token" else "right", no_wrap=True)
    for i in range(len(data["t"])):
        cells = []
        for name in COLUMNS:
            value = data[name][i]
            cells.append(str(value) if name in ("t", "token") else f"{float(value):+.6f}")
        table.add_row(*cells)
    console.print(table)
    for name, meaning in COLUMNS.items():
        console.print(f"  [bold]{HEADERS.get(name, name)}[/bold]: {meaning}")


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
    explain = sub.add_parser("explain", help="per-token table of every RL quantity")
    explain.add_argument("--example", action="store_true", help="the spec 000 worked example")
    args = parser.parse_args(argv)
    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    if args.command == "explain":
        if not args.example:
            parser.error("explain: only --example is available so far")
        print_example(console)
        return 0
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
    summary = trainer.fit()
    print_summary(console, summary.as_dict())
    return 0


if __name__ == "__main__":
    sys.exit(main())
