"""``creditrl export RUN_DIR OUT_DIR``: a run's checkpoint as a Hugging Face model directory.

The newest complete checkpoint (or ``--step N``'s) becomes config.json, generation_config.json,
the tokenizer files with the chat template, safetensors weights (``--dtype``, sharded past
``--max-shard-size``) and a model card (README.md). A LoRA run exports merged weights, or with
``--adapter`` the adapter alone as a peft directory. ``AutoModelForCausalLM.from_pretrained``
and ``AutoTokenizer.from_pretrained`` load the directory without creditrl.
"""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console

from creditrl.errors import UserError
from creditrl.plain_text import as_text


def run(args: argparse.Namespace, console: Console) -> int:
    """Handle ``creditrl export``."""
    from creditrl.console import print_error, print_warning
    from creditrl.exporting import export

    try:
        result = export(
            args.run_dir,
            args.out_dir,
            step=args.step,
            dtype=args.dtype,
            adapter=args.adapter,
            overwrite=args.overwrite,
            max_shard_size=args.max_shard_size,
            trust_run_code=args.trust_run_code,
        )
    except UserError as err:
        print_error(console, err)
        return 2
    for line in result.skipped:
        print_warning(console, f"checkpoint {line} is damaged; exported an older one")
    for line in result.notes:
        print_warning(console, line)
    what = "adapter" if args.adapter else "model"
    console.print(
        as_text(
            f"exported the {what} of step {result.step} ({result.checkpoint}) to "
            f"{result.out_dir}: {', '.join(result.files)}"
        ),
        soft_wrap=True,
    )
    return 0


def register(sub: Any) -> None:
    """Add ``export`` to the CLI."""
    from creditrl.config.run_config import TRUST_FLAG, TRUST_HELP
    from creditrl.exporting.options import DEFAULT_MAX_SHARD_SIZE, DTYPES

    cmd = sub.add_parser(
        "export",
        help="write a run's checkpoint as a Hugging Face model directory (with a model card)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cmd.add_argument("run_dir", metavar="RUN_DIR", help="a run directory or RUN/checkpoints/step_N")
    cmd.add_argument("out_dir", metavar="OUT_DIR", help="where to write (new or empty)")
    cmd.add_argument("--step", type=int, help="the checkpoint of step N (default: the newest)")
    cmd.add_argument(
        "--dtype", choices=DTYPES, help="weights' dtype (default: the run's model.dtype)"
    )
    cmd.add_argument(
        "--adapter", action="store_true", help="a LoRA run's adapter alone (a peft directory)"
    )
    cmd.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier export in OUT_DIR (a directory of other files is refused)",
    )
    cmd.add_argument(TRUST_FLAG, action="store_true", help=TRUST_HELP)
    cmd.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        metavar="SIZE",
        help=f"split safetensors files past SIZE (default {DEFAULT_MAX_SHARD_SIZE})",
    )
    cmd.set_defaults(handler=run)
