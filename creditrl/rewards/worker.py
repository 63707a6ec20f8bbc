"""Reward worker process: ``python -m creditrl.rewards.worker`` scores JSON-line requests.

Wire protocol: one JSON object per line (ASCII, UTF-8 safe) in each direction; nothing else
crosses the process boundary.

- worker -> parent, once when ready: ``{"ready": true, "pid": int}``
- parent -> worker: ``{"id", "scorer", "scorer_kwargs", "data_source", "solution_str",
  "ground_truth", "extra_info"}`` (``scorer``: a built-in name or "path/to/file.py:fn")
- worker -> parent: ``{"id", "status": "ok" | "error" | "nan", "score": float | null,
  "extra": {...}, "error": str | null}``, within ``creditrl.rewards.results``' bounds

The protocol uses private duplicates of stdin/stdout; fd 1 is pointed at stderr, so a scorer's
``print`` cannot corrupt it. The worker exits on stdin EOF or when its parent process dies.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

from creditrl.rewards.registry import get_scorer
from creditrl.rewards.results import check_numbers, encode_extra, failure

__all__ = ["main", "normalize_result", "score_request"]


def normalize_result(raw: Any) -> tuple[float, dict[str, Any]]:
    """(score, extra) from a scorer's return value: a number, or a dict holding "score"."""
    extra: dict[str, Any] = {}
    if isinstance(raw, dict):
        if "score" not in raw:
            raise TypeError(f"scorer returned a dict without 'score' (keys: {sorted(raw)})")
        extra = {k: v for k, v in raw.items() if k != "score"}
        raw = raw["score"]
    if isinstance(raw, str) or not hasattr(raw, "__float__"):
        raise TypeError(f"scorer returned {type(raw).__name__}, expected a number or a dict")
    return float(raw), extra


def score_request(request: dict[str, Any]) -> dict[str, Any]:
    """Score one decoded request into a JSON-clean reply; a scorer that raises, or a result
    outside ``creditrl.rewards.results``' bounds, becomes a status with its reason, not a raise.

    Status "error": the scorer raised, or its extras are too deep or too large; "nan": its score
    is not finite or beyond +-``MAX_SCORE``, or a number in its extras is not a finite float32.
    A failed sample's reply carries no extras.
    """
    reply: dict[str, Any] = {"id": request.get("id"), "score": None, "extra": {}, "error": None}
    try:
        fn = get_scorer(request["data_source"], request["scorer"])
        raw = fn(
            request["data_source"],
            request["solution_str"],
            request["ground_truth"],
            request.get("extra_info"),
            **(request.get("scorer_kwargs") or {}),
        )
        score, extra = normalize_result(raw)
    except Exception as e:
        tb = traceback.extract_tb(e.__traceback__)
        where = f" (at {tb[-1].filename}:{tb[-1].lineno})" if tb else ""
        return {**reply, **failure("error", f"{type(e).__name__}: {e}{where}")}
    encoded, problem = encode_extra(extra)
    if encoded is None:
        return {**reply, **failure("error", f"scorer result refused: {problem}")}
    reason = check_numbers(score, extra)
    if reason is not None:
        return {**reply, **failure("nan", reason)}
    reply.update(status="ok", score=score, extra=json.loads(encoded))
    return reply


def encode_line(obj: dict[str, Any]) -> str:
    """One protocol line; values JSON cannot hold (in extras) become their str()."""
    return json.dumps(obj, default=str) + "\n"


def _exit_when_orphaned(parent: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(0)


def main() -> None:
    """Serve requests until stdin closes."""
    proto_in = os.fdopen(os.dup(0), "r", encoding="utf-8")
    proto_out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    # Ctrl-C in a terminal reaches the whole process group; the parent ends this worker (stdin
    # EOF or a kill), so the interrupt is not reported here too, as a traceback
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    proto_out.write(encode_line({"ready": True, "pid": os.getpid()}))
    proto_out.flush()
    for line in proto_in:
        if not line.strip():
            continue
        try:
            request = json.loads(line)
        except json.JSONDecodeError as e:
            reply = {"id": None, "status": "error", "score": None, "extra": {}, "error": str(e)}
        else:
            reply = score_request(request)
        proto_out.write(encode_line(reply))
        proto_out.flush()


if __name__ == "__main__":
    main()
