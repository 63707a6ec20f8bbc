"""A copy of the policy in another dtype to sample with (``rollout.engine_kwargs.sample_dtype``).

The actor keeps float32 master weights; sampling from a bfloat16 copy halves the bytes a decode
step reads and runs bf16 products. The copy is refreshed from the master before each call by
``copy_`` into its own tensors, so their storage never moves and CUDA graphs captured over it
(``rollout.cuda_graph``, keyed on the parameters' ``data_ptr``s) stay valid.

Its log-probs are the copy's: not the float32 forward's, nor the bf16-autocast update's (there
the residual stream and norms stay float32). So the config (``creditrl.workers.checks``) asks for
rollout importance sampling (``algorithm.rollout_is``) with it: the trainer then recomputes
``old_log_probs`` with the actor in the update's own precision (float32 or bf16 autocast;
``pipeline.step.rollout_log_probs_reusable``), so the PPO ratio starts at exactly 1, reports the
sampler-trainer gap as ``rollout_corr/*`` and corrects it with the IS weights. It is opt-in and
refused on a CPU without avx512_bf16 or amx_bf16, where bf16 products are slower than float32;
the start-up line says which dtype the engine samples in (``workers.precision.sampling_choice``).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["SamplerCopy"]


class SamplerCopy:
    """A ``dtype`` copy of a master module, made at the first ``refreshed`` and refreshed in
    place (same tensors) at every later one; a different master makes a new copy."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.master: nn.Module | None = None
        self.module: nn.Module | None = None

    def refreshed(self, master: nn.Module) -> nn.Module:
        """The copy, holding ``master``'s current weights rounded to ``dtype``."""
        if self.module is None or self.master is not master:
            module = copy.deepcopy(master).to(self.dtype).eval().requires_grad_(False)
            for param in module.parameters():
                param.grad = None
            self.master, self.module = master, module
            return module
        with torch.no_grad():
            target = self.module.state_dict()
            for name, tensor in master.state_dict().items():
                target[name].copy_(tensor)
        return self.module
