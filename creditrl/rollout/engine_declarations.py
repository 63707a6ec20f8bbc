"""An engine's declarations checked once, when it is built (``build_rollout_engine``).

Callers read what an engine declares (``creditrl.rollout.engine.RolloutEngine``) instead of
probing it, so a wrong declaration of a user's engine would surface far from it: ``capped(n)``
returning None as an AttributeError at the first agent turn, text EOS ids as a ValueError, a
negative context length as every episode refused. ``check_declarations`` reads each one once
and refuses the engine in one ``UserCodeError`` line naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from creditrl.errors import UserCodeError
from creditrl.usercode import one_line

__all__ = ["check_declarations"]


def _token_ids(value: Any) -> bool:
    if value is None:
        return True
    if torch.is_tensor(value):
        return value.dim() == 1 and not value.is_floating_point() and bool((value >= 0).all())
    return isinstance(value, Sequence) and all(
        isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value
    )


def _positive_or_none(value: Any) -> bool:
    return value is None or (isinstance(value, int) and not isinstance(value, bool) and value > 0)


def check_declarations(engine: Any, name: str, max_new_tokens: int, interface: type) -> None:
    """UserCodeError naming ``rollout.engine=name`` unless ``engine``'s declarations hold:
    ``eos_token_ids`` None or token ids, ``last_stats`` a mapping, ``keeps_turn_kv()`` a bool,
    ``context_length()`` None or a positive int, ``capped(max_new_tokens)`` an ``interface``
    (``RolloutEngine``) instance."""

    def refuse(what: str) -> UserCodeError:
        return UserCodeError(one_line(f"rollout.engine={name}: {what}", 400))

    def call(label: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as e:
            raise refuse(f"{label} raised {type(e).__name__}: {e}") from None

    eos = engine.eos_token_ids
    if not _token_ids(eos):
        raise refuse(f"eos_token_ids must be None or token ids (ints >= 0), got {eos!r:.100}")
    if not isinstance(engine.last_stats, Mapping):
        raise refuse(f"last_stats must be a mapping, got a {type(engine.last_stats).__name__}")
    keeps = call("keeps_turn_kv()", engine.keeps_turn_kv)
    if not isinstance(keeps, bool):
        raise refuse(f"keeps_turn_kv() must return a bool, got {keeps!r:.100}")
    positions = call("context_length()", engine.context_length)
    if not _positive_or_none(positions):
        raise refuse(f"context_length() must be None or a positive int, got {positions!r:.100}")
    view = call(f"capped({max_new_tokens})", lambda: engine.capped(max_new_tokens))
    if not isinstance(view, interface):
        raise refuse(
            f"capped({max_new_tokens}) returned a {type(view).__name__}, not a RolloutEngine "
            "(itself, or a view of it sampling at most that many tokens a call)"
        )
