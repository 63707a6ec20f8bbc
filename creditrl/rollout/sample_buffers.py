"""The buffers a decode loop writes one micro-batch's samples into, a step at a time."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SampleBuffers"]


@dataclass
class SampleBuffers:
    """``responses`` (m, L) right-padded, ``log_probs`` (m, L), ``lengths`` (m,) and ``kept``
    (m, L), the kept-set sizes (None: not recorded), of m rows of at most L tokens."""

    responses: torch.Tensor
    log_probs: torch.Tensor
    lengths: torch.Tensor
    kept: torch.Tensor | None

    @classmethod
    def empty(
        cls, m: int, width: int, pad_token_id: int, with_kept: bool, device: torch.device
    ) -> SampleBuffers:
        """Room for ``width`` tokens a row: pad ids, log-probs 0, every length ``width``."""
        return cls(
            torch.full((m, width), pad_token_id, dtype=torch.long, device=device),
            torch.zeros((m, width), dtype=torch.float32, device=device),
            torch.full((m,), width, dtype=torch.long, device=device),
            torch.zeros((m, width), dtype=torch.long, device=device) if with_kept else None,
        )

    def write(
        self, step: int, rows: torch.Tensor, alive: torch.Tensor, sampled: tuple[torch.Tensor, ...]
    ) -> None:
        """Column ``step`` of rows ``rows[alive]`` from ``sampled``: the tokens, log-probs and
        (when recorded) kept-set sizes of every row in ``rows``."""
        live_rows = rows[alive]
        self.responses[live_rows, step] = sampled[0][alive]
        self.log_probs[live_rows, step] = sampled[1][alive]
        if self.kept is not None:
            self.kept[live_rows, step] = sampled[2][alive]

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(responses, log_probs, lengths, kept)."""
        return self.responses, self.log_probs, self.lengths, self.kept
