"""``creditrl explain``: every token's RL quantities, as a table (and an HTML page).

Three sources:

- ``creditrl explain --example``: the spec 000 worked example;
- ``creditrl explain RUN_DIR [--step N] [--row I] [key=value ...]``: a run's rollout dump;
- ``creditrl explain --prompt TEXT --response TEXT [...] [CONFIG.yaml] [key=value ...]``:
  computed on the spot with ``model.path`` (and ``--critic``, ``--actor``).

``--theta CHECKPOINT`` adds log π_θ, the ratio and the clip flag; ``--html FILE`` writes the
page; ``--tsv`` prints tab-separated values instead of the table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from creditrl.config.loader import ConfigError, load_config
from creditrl.config.run_config import TRUST_FLAG, TRUST_HELP
from creditrl.inspect.columns import COLUMNS, NUMERIC
from creditrl.inspect.view import TokenView
from creditrl.plain_text import as_text, plain


def _check_encodable(option: str, text: str) -> None:
    """ValueError naming ``option`` when ``text`` holds a lone surrogate (an argument that was
    not valid UTF-8): no tokenizer can encode it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        bad = plain(err.object[err.start : err.end])
        raise ValueError(
            f"{option} holds {bad} at character {err.start}, which is not text (invalid UTF-8)"
        ) from None


def _views(args: argparse.Namespace) -> list[TokenView]:
    """The views the arguments ask for (loads models only when they are needed)."""
    if args.example:
        from creditrl.inspect.example import example_view

        return [example_view()]
    items = list(args.args)
    if args.prompt is not None:
        if not args.response:
            raise ValueError("--prompt needs at least one --response")
        _check_encodable("--prompt", args.prompt)
        for response in args.response:
            _check_encodable("--response", response)
        config_file = items.pop(0) if items and "=" not in items[0] else None
        from creditrl.inspect.from_text import views_from_text

        return views_from_text(
            args.prompt,
            args.response,
            load_config(config_file, items),
            score=args.score,
            ground_truth=args.ground_truth,
            data_source=args.data_source,
            actor=args.actor,
            critic=args.critic,
            theta=args.theta,
            raw_prompt=args.raw_prompt,
            eos=not args.no_eos,
        )
    if not items or "=" in items[0]:
        raise ValueError("give RUN_DIR, --prompt/--response, or --example (see --help)")
    run_dir = Path(items.pop(0))
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    from creditrl.inspect.from_run import views_from_run

    return views_from_run(
        run_dir, args.step, args.row, items, args.theta, trust_run_code=args.trust_run_code
    )


def run(args: argparse.Namespace, console: Console) -> int:
    """Handle ``creditrl explain``."""
    from creditrl.inspect.table import print_views, tsv

    try:
        args = _reparse(args)
        columns = (
            [c.strip() for c in args.columns.split(",") if c.strip()] if args.columns else None
        )
        views = _views(args)
        if args.tsv:
            sys.stdout.write(tsv(views, columns))
        else:
            print_views(views, console, columns, legend=not args.no_legend)
        if args.html:
            from creditrl.inspect.html import write_html

            path = write_html(views, args.html, args.color_by)
            console.print("wrote", as_text(path))
    except (ValueError, FileNotFoundError, KeyError, ConfigError) as err:
        console.print("[red]explain:[/red]", as_text(err), soft_wrap=True)
        return 2
    return 0


def _add_options(cmd: argparse.ArgumentParser) -> None:
    cmd.add_argument("--example", action="store_true", help="the spec 000 worked example")
    cmd.add_argument("--step", type=int, help="dumped step to show (default: the last)")
    cmd.add_argument(
        "--row", type=int, action="append", help="batch row(s) to show (default: all dumped)"
    )
    cmd.add_argument("--prompt", help="prompt text (put through the chat template)")
    cmd.add_argument(
        "--response", action="append", help="response text; repeat for a group of responses"
    )
    cmd.add_argument("--ground-truth", help="reference answer for the configured scorer")
    cmd.add_argument("--data-source", help="scorer's data_source (default: the data.task's)")
    cmd.add_argument("--score", type=float, help="sequence score to use instead of a scorer")
    cmd.add_argument("--actor", help="π_old weights: a run checkpoint dir or a model dir")
    cmd.add_argument("--critic", help="critic: a run checkpoint dir or a saved critic dir")
    cmd.add_argument(
        "--theta",
        help="π_θ weights: a run checkpoint dir (RUN/checkpoints = the latest) or a model dir; "
        "adds log π_θ, the ratio and the clip flag",
    )
    cmd.add_argument("--raw-prompt", action="store_true", help="no chat template on --prompt")
    cmd.add_argument("--no-eos", action="store_true", help="do not end responses with EOS")
    cmd.add_argument("--html", help="also write a self-contained HTML page to this file")
    cmd.add_argument(
        "--color-by",
        default="advantage",
        choices=NUMERIC,
        help="quantity that colours the tokens in --html (default: advantage)",
    )
    cmd.add_argument("--columns", help=f"comma-separated columns to print, from {list(COLUMNS)}")
    cmd.add_argument("--tsv", action="store_true", help="tab-separated values, no table")
    cmd.add_argument("--no-legend", action="store_true", help="omit the legend")
    cmd.add_argument(TRUST_FLAG, action="store_true", help=f"with RUN_DIR: {TRUST_HELP}")


_POSITIONAL_HELP = "RUN_DIR [key=value ...]; with --prompt: [CONFIG.yaml] [key=value ...]"


def _reparse(args: argparse.Namespace) -> argparse.Namespace:
    """Options may follow the positional items (``RUN_DIR key=value --step 3``): the
    subcommand keeps everything from the first positional on, and it is parsed again here."""
    inner = argparse.ArgumentParser(prog="creditrl explain", add_help=False)
    inner.add_argument("args", nargs="*")
    _add_options(inner)
    given = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != "args"})
    return inner.parse_intermixed_args(args.args, namespace=given)


def register(sub: Any) -> None:
    """Add ``explain`` to the CLI."""
    cmd = sub.add_parser(
        "explain",
        help="per-token table of every RL quantity (a run's dump, a prompt, or the example)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cmd.add_argument("args", nargs=argparse.REMAINDER, help=_POSITIONAL_HELP)
    _add_options(cmd)
    cmd.set_defaults(handler=run)
