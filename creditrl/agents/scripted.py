"""A turn generator whose outputs are given token ids: forced trajectories for tests and demos.

``ScriptedTurnGenerator(scripts)``: ``scripts[sample][turn - 1]`` are the ids sample ``sample``
produces at turn ``turn`` (cut to the request's budget); a sample past its script produces the
first EOS id. Log-probs are those of the forced ids under ``model`` (a causal LM, at
``temperature``) when one is given, else ``-0.5`` for every token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from creditrl.rollout.continuation import TurnOutput, TurnRequest

__all__ = ["ScriptedTurnGenerator"]


class ScriptedTurnGenerator:
    """See the module docstring. ``requests`` records every request received, in order."""

    def __init__(
        self,
        scripts: Sequence[Sequence[Sequence[int]]],
        eos_token_ids: Sequence[int],
        model: Any = None,
        temperature: float = 1.0,
    ) -> None:
        self.scripts = [[list(turn) for turn in sample] for sample in scripts]
        self.eos_token_ids = [int(t) for t in eos_token_ids]
        self.model = model
        self.temperature = temperature
        self.requests: list[TurnRequest] = []

    def _ids(self, request: TurnRequest) -> list[int]:
        if not 0 <= request.sample < len(self.scripts):
            raise IndexError(f"no script for sample {request.sample}")
        script = self.scripts[request.sample]
        ids = script[request.turn - 1] if request.turn - 1 < len(script) else self.eos_token_ids[:1]
        return ids[: request.max_new_tokens]

    @torch.no_grad()
    def _log_probs(self, context: list[int], ids: list[int]) -> list[float]:
        if self.model is None:
            return [-0.5] * len(ids)
        full = torch.tensor([context + ids], device=self.model.device)
        keep = len(ids) + 1  # logits of the positions before each new token (and the last)
        logits = self.model(input_ids=full, logits_to_keep=keep).logits[0, -keep:-1].float()
        logp = (logits / self.temperature).log_softmax(-1)
        return logp.gather(-1, torch.tensor(ids, device=logp.device)[:, None]).squeeze(-1).tolist()

    def generate_turns(
        self,
        requests: Sequence[TurnRequest],
        *,
        greedy: bool = False,
        temperature: float | None = None,
    ) -> list[TurnOutput]:
        """The scripted ids of each request's sample and turn."""
        out = []
        for request in requests:
            self.requests.append(request)
            ids = self._ids(request)
            out.append(TurnOutput(ids, self._log_probs(list(request.ids), ids)))
        return out
