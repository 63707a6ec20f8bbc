"""How long the light commands take to start, each in fresh processes.

    python benchmarks/startup.py                 # this checkout
    python benchmarks/startup.py --repo OTHER    # another checkout of creditrl (e.g. a worktree
                                                 # of an older commit), in this Python

Each command runs ``--runs`` times (after one warm-up) as ``python -c`` that runs the CLI's
``main`` and then reports whether torch, transformers or tensordict were imported; the median
wall time is printed with the minimum and maximum, and the CPU model and flags first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from machine import cpu_flags

COMMANDS = {
    "config --doc rollout.top_p": ["config", "--doc", "rollout.top_p"],
    "config": ["config"],
    "config (refused key)": ["config", "algorithm.adv_estimator=nope"],
    "--help": ["--help"],
}
HEAVY = ("torch", "transformers", "tensordict")
RUNNER = """
import contextlib, io, json, sys
sys.path.insert(0, {repo!r})
from creditrl.cli import main
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    try:
        main({argv!r})
    except SystemExit:
        pass
print(json.dumps(sorted(m for m in {heavy!r} if m in sys.modules)))
"""


def run_once(repo: Path, argv: list[str]) -> tuple[float, list[str]]:
    """(wall seconds, heavy modules imported) of one fresh process."""
    code = RUNNER.format(repo=str(repo), argv=argv, heavy=HEAVY)
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo
    ).stdout
    return time.perf_counter() - start, json.loads(out.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    print(f"cpu: {cpu_flags()}")
    print(f"repo: {args.repo}")
    print(f"{'command':32} {'median s':>9} {'min':>6} {'max':>6}  heavy modules imported")
    for name, argv in COMMANDS.items():
        run_once(args.repo, argv)  # warm-up (file caches)
        times, heavy = [], []
        for _ in range(args.runs):
            seconds, heavy = run_once(args.repo, argv)
            times.append(seconds)
        print(
            f"{name:32} {statistics.median(times):9.2f} {min(times):6.2f} {max(times):6.2f}  "
            f"{', '.join(heavy) or 'none'}"
        )


if __name__ == "__main__":
    main()
