"""What a Tinker recipe did, in creditrl's run format, so ``creditrl report`` and ``creditrl
explain`` read it: one run folder per training model, ``OUT/<model id>/``.

- ``metrics.jsonl`` (``creditrl.tracking.sinks.JsonlSink``): one line per ``optim_step``
  (``step`` = optimizer steps so far), under the names the report plots: the summed loss of
  the ``forward_backward`` calls since the previous step (``actor/pg_loss``, a sum over
  tokens as Tinker's), ``actor/pg_clipfrac``, ``actor/ppo_kl``, ``tinker/tokens``,
  ``tinker/datums``, the step's ``actor/grad_norm`` and ``actor/lr``, the samples drawn since
  (``tinker/sampled_tokens``, ``response_length/mean``) and the worker's seconds per call
  kind (``timing_s/forward_backward``, ``timing_s/optim_step``, ``timing_s/sample``);
- ``rollouts/step_NNNNNN.jsonl`` (``creditrl.tracking.rollout_dump.RolloutDumper``): the
  datums trained on at that step, each split into a prompt (up to its first position with a
  non-zero advantage or weight, else its first sampled token) and a response, with
  per-token ``response_mask`` (1 on the trained positions), ``rollout_log_probs`` =
  ``old_log_probs`` (the sampler's log-probs, for the ratio losses) and ``advantages`` (the
  advantages, or cross-entropy's weights).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from creditrl.batch import Batch
from creditrl.tinker.messages import Datum
from creditrl.tracking.rollout_dump import RolloutDumper
from creditrl.tracking.sinks import JsonlSink

__all__ = ["RunRecord"]

DUMP_ROWS = 4  # datums per step with per-token values
# Tinker metric name -> the name creditrl's report plots (verl's); others become tinker/<name>
NAMES = {
    "loss": "actor/pg_loss",
    "pg_clipfrac": "actor/pg_clipfrac",
    "ppo_kl": "actor/ppo_kl",
    "grad_norm": "actor/grad_norm",
    "learning_rate": "actor/lr",
}


def _name(key: str) -> str:
    name = key.partition(":")[0]
    return NAMES.get(name, f"tinker/{name}")


def _split(datum: Datum) -> int:
    """The first target position trained on (advantage or weight non-zero), else the first
    sampled one (sampler log-prob non-zero), else 0."""
    for name in ("advantages", "weights", "logprobs"):
        if name in datum.inputs:
            nonzero = (datum.inputs[name] != 0).nonzero()
            if len(nonzero):
                return int(nonzero[0])
    return 0


def dump_batch(datums: Sequence[Datum], pad_id: int) -> Batch:
    """Datums as a left-padded prompt / right-padded response Batch for ``RolloutDumper``."""
    splits = [_split(d) for d in datums]
    sequences = [[*d.tokens, int(d.inputs["target_tokens"][-1])] for d in datums]
    prompt_len = max(s + 1 for s in splits)
    width = max(len(d.tokens) - s for d, s in zip(datums, splits, strict=True))
    rows = len(datums)
    prompts = torch.full((rows, prompt_len), pad_id, dtype=torch.long)
    responses = torch.full((rows, width), pad_id, dtype=torch.long)
    attention = torch.zeros((rows, prompt_len + width), dtype=torch.long)
    fields = {
        name: torch.zeros((rows, width))
        for name in ("response_mask", "rollout_log_probs", "old_log_probs", "advantages")
    }
    for i, (datum, split, seq) in enumerate(zip(datums, splits, sequences, strict=True)):
        head, tail = seq[: split + 1], seq[split + 1 :]
        prompts[i, prompt_len - len(head) :] = torch.tensor(head)
        responses[i, : len(tail)] = torch.tensor(tail, dtype=torch.long)
        attention[i, prompt_len - len(head) : prompt_len + len(tail)] = 1
        fields["response_mask"][i, : len(tail)] = 1
        if "logprobs" in datum.inputs:
            fields["rollout_log_probs"][i, : len(tail)] = datum.inputs["logprobs"][split:]
            fields["old_log_probs"][i, : len(tail)] = datum.inputs["logprobs"][split:]
        for name in ("advantages", "weights"):
            if name in datum.inputs:
                fields["advantages"][i, : len(tail)] = datum.inputs[name][split:].float()
                break
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention,
        **fields,
    }
    if not any("logprobs" in d.inputs for d in datums):
        del tensors["rollout_log_probs"], tensors["old_log_probs"]
    return Batch.from_dict(tensors)


class RunRecord:
    """The metrics and rollout dumps of one training model, in ``folder``."""

    def __init__(self, folder: Path, tokenizer, pad_id: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.sink = JsonlSink(folder)
        self.dumper = RolloutDumper(folder, DUMP_ROWS, tokenizer)
        self.pad_id = pad_id
        self.step = 0
        self.pending: dict[str, float] = {}
        self.datums: list[Datum] = []
        self.samples = 0
        self.sampled_tokens = 0

    def timed(self, stage: str, seconds: float) -> None:
        """Worker seconds spent on ``stage`` (forward_backward, optim_step, sample)."""
        slot = f"timing_s/{stage}"
        self.pending[slot] = self.pending.get(slot, 0.0) + seconds

    def trained(self, datums: Sequence[Datum], loss_fn: str, metrics: dict[str, float]) -> None:
        """A forward_backward call: its metrics add up until the next step; its datums are
        dumped then."""
        for key, value in metrics.items():
            slot, reduction = _name(key), key.partition(":")[2]
            if reduction == "mean":
                self.pending[slot] = value
            else:
                self.pending[slot] = self.pending.get(slot, 0.0) + value
        self.pending["tinker/datums"] = self.pending.get("tinker/datums", 0.0) + len(datums)
        self.pending[f"tinker/loss_fn/{loss_fn}"] = 1.0
        self.datums.extend(datums)

    def sampled(self, lengths: Sequence[int]) -> None:
        """A sampling call's response lengths."""
        self.samples += len(lengths)
        self.sampled_tokens += sum(lengths)

    def stepped(self, metrics: dict[str, float]) -> None:
        """An optim_step: write the step's line and dump its datums."""
        self.step += 1
        row = dict(self.pending)
        row.update({_name(k): v for k, v in metrics.items()})
        if self.samples:
            row["tinker/sampled_tokens"] = float(self.sampled_tokens)
            row["response_length/mean"] = self.sampled_tokens / self.samples
        self.sink.log(row, self.step)
        if self.datums:
            self.dumper.dump(dump_batch(self.datums, self.pad_id), self.step)
        self.pending, self.datums = {}, []
        self.samples = self.sampled_tokens = 0

    def close(self) -> None:
        self.sink.close()
