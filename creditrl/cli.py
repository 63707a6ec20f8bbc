"""The ``creditrl`` command: train, config, eval, and the subcommands in ``creditrl.commands``."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
from pathlib import Path

from rich.console import Console

from creditrl.commands import SUBCOMMANDS
from creditrl.config import Config
from creditrl.config.loader import load_config_with_sources, to_dict
from creditrl.console import log_plainly, print_error, print_warning
from creditrl.errors import UserError
from creditrl.plain_text import as_text


def describe_sizes(cfg: Config) -> str:
    """The resolved batch sizes, each with its unit (a mini-batch larger than the batch is the
    whole batch)."""
    n, batch = cfg.rollout.n, cfg.data.train_batch_size
    mini = min(cfg.actor.ppo_mini_batch_size, batch)
    return (
        f"step: {batch} prompts x rollout.n {n} = {batch * n} trajectories; "
        f"actor update: {-(-batch // mini)} optimizer step(s) of {mini * n} trajectories x "
        f"{cfg.actor.ppo_epochs} epoch(s), "
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
        ("config", "print the resolved config, or with --doc what every key means"),
    ]:
        cmd = sub.add_parser(name, help=text)
        cmd.add_argument("args", nargs="*", help="[CONFIG.yaml] [key=value ...]")
        if name == "config":
            cmd.add_argument(
                "--doc",
                nargs="?",
                const="",
                metavar="SECTION",
                help="print every key (or SECTION's, e.g. actor, algorithm.rollout_is, or one "
                "key): type, default, allowed values and what it does",
            )
            cmd.add_argument(
                "--markdown", action="store_true", help="with --doc: as docs/config.md"
            )
    for module in SUBCOMMANDS:
        importlib.import_module(module).register(sub)
    args = parser.parse_args(argv)
    log_plainly()
    console = Console(highlight=False, emoji=False)
    if not console.is_terminal:
        console = Console(width=160, highlight=False, emoji=False)
    try:
        if getattr(args, "handler", None) is not None:
            return int(args.handler(args, console))
        config_file, overrides = _split_args(args.args)
        if getattr(args, "doc", None) is not None or getattr(args, "markdown", False):
            return _doc(args, console)
        return _run(args.command, config_file, overrides, console)
    except UserError as err:
        print_error(console, err)
        return 2
    except OSError as err:
        if err.filename is None:
            raise
        print_error(console, path_error(err))
        return 2
    except KeyboardInterrupt:
        print_warning(console, "interrupted")
        return 130


def path_error(err: OSError) -> str:
    """One line for a path the system refused (a name too long, no permission, a full disk):
    the path and the system's reason; the paths come from the user's arguments or config."""
    paths = " -> ".join(str(p) for p in (err.filename, err.filename2) if p is not None)
    return f"cannot use {paths}: {err.strerror or err}"


def _doc(args: argparse.Namespace, console: Console) -> int:
    """``config [CONFIG] [overrides] --doc [SECTION] [--markdown]``: the keys' docs on stdout
    (defaults only); a CONFIG or overrides are loaded first, only so that the options declared
    by their ``trainer.extensions`` are listed too."""
    from creditrl.config.doc import render_markdown, render_text

    if args.doc is None:
        raise UserError("--markdown goes with --doc: creditrl config --doc [SECTION] --markdown")
    items = list(args.args)
    if "=" in args.doc:  # `config --doc key=value`: argparse took the override as SECTION
        items, args.doc = [*items, args.doc], ""
    if items:
        load_config_with_sources(*_split_args(items))
    if args.markdown:
        sys.stdout.write(render_markdown(args.doc or None))
    else:
        sys.stdout.write(render_text(args.doc or None, min(console.width, 100)))
    return 0


def _run(command: str, config_file: Path | None, overrides: list[str], console: Console) -> int:
    """train/run or config; a UserError anywhere propagates to ``main``."""
    loaded = load_config_with_sources(config_file, overrides)
    cfg = loaded.config
    for line in loaded.warnings:
        print_warning(console, line)
    if command == "config":
        from omegaconf import OmegaConf

        console.print(as_text(OmegaConf.to_yaml(to_dict(cfg))))
        console.print(describe_sizes(cfg))
        return 0
    from creditrl.tracking import print_summary
    from creditrl.trainers.rl_trainer import RLTrainer

    console.print(describe_sizes(cfg))
    trainer = RLTrainer(cfg, console=console)
    from creditrl.controller.ray_group import WorkerError

    try:
        summary = trainer.fit()
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: no traceback now
        print_warning(console, trainer.interruption())
        return 130
    except WorkerError as err:
        console.print("[red]worker error:[/red]", as_text(err))
        console.print(
            as_text(
                "the run stopped; rerun the same command to resume from the last checkpoint in "
                f"{Path(cfg.trainer.output_dir) / 'checkpoints'}"
            )
        )
        return 1
    print_summary(console, summary.as_dict())
    return 0


if __name__ == "__main__":
    sys.exit(main())
