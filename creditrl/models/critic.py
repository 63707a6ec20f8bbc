"""The value model: the causal LM's transformer backbone plus a scalar value head."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoModel, PreTrainedModel

from creditrl.models.loading import (
    ATTN_IMPLEMENTATION,
    enable_checkpointing,
    from_local,
    local_model_dir,
    resolve_model_path,
    torch_dtype,
)
from creditrl.models.model_dir import ModelNotFoundError

__all__ = ["VALUE_HEAD_FILE", "CriticModel"]

VALUE_HEAD_FILE = "value_head.safetensors"


class CriticModel(nn.Module):
    """V(s) for every prefix: ``values[b, i]`` = head(h[b, i]), h the backbone's last hidden
    state at position i (after the final norm), i.e. the value of the state that has seen tokens
    0..i. The trainer slices ``values[:, -T-1:-1]`` so that response column j is V(s_{j+1}).

    The head is float32 whatever the backbone dtype, and starts at zero (weight and bias): the
    first values are exactly 0, so the first GAE advantages are the plain returns and do not
    depend on a random seed, while the head still gets a gradient at once (dL/dw = h * dL/dV);
    the backbone receives gradient from the second update on (TRL and verl use a small random
    init instead; with a random head the first advantages are noise of the head's scale).

    ``autocast``: 'bf16' runs the backbone under bfloat16 autocast on its device (the update's
    precision, ``Placement.autocast``; the head stays float32 outside it), 'none' in its dtype.
    """

    def __init__(
        self,
        backbone: PreTrainedModel,
        value_head: nn.Linear | None = None,
        autocast: str = "none",
    ) -> None:
        super().__init__()
        if autocast not in ("bf16", "none"):
            raise ValueError(f"autocast must be 'bf16' or 'none', got {autocast!r}")
        self.backbone = backbone
        self.autocast = autocast
        if value_head is None:
            value_head = nn.Linear(backbone.config.hidden_size, 1, dtype=torch.float32)
            nn.init.zeros_(value_head.weight)
            nn.init.zeros_(value_head.bias)
        self.value_head = value_head

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Values (B, L) float32, one per input position."""
        device = input_ids.device.type
        with torch.autocast(device, dtype=torch.bfloat16, enabled=self.autocast == "bf16"):
            hidden = self.backbone(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                use_cache=False,
            ).last_hidden_state
        return self.value_head(hidden.float()).squeeze(-1)

    @classmethod
    def from_actor(
        cls,
        path: str | Path,
        dtype: str | torch.dtype = "float32",
        cache_dir: str | None = None,
        gradient_checkpointing: bool = False,
        attn_implementation: str = ATTN_IMPLEMENTATION,
        autocast: str = "none",
    ) -> CriticModel:
        """Backbone from a causal-LM directory (or ``"embedded"``), zero value head."""
        directory = resolve_model_path(path, cache_dir)
        backbone = from_local(AutoModel, directory, torch_dtype(dtype), attn_implementation)
        return cls._finish(backbone, None, gradient_checkpointing, autocast)

    @classmethod
    def load(
        cls,
        directory: str | Path,
        dtype: str | torch.dtype = "float32",
        gradient_checkpointing: bool = False,
        attn_implementation: str = ATTN_IMPLEMENTATION,
        autocast: str = "none",
    ) -> CriticModel:
        """A critic written by :meth:`save` (backbone directory + ``value_head.safetensors``)."""
        directory = local_model_dir(directory)
        head_file = directory / VALUE_HEAD_FILE
        if not head_file.is_file():
            raise ModelNotFoundError(
                f"{directory} has no {VALUE_HEAD_FILE}: not a saved critic "
                "(use CriticModel.from_actor to start a critic from a causal LM)"
            )
        backbone = from_local(AutoModel, directory, torch_dtype(dtype), attn_implementation)
        tensors = load_file(str(head_file))
        head = nn.Linear(backbone.config.hidden_size, 1, dtype=torch.float32)
        head.load_state_dict({"weight": tensors["weight"], "bias": tensors["bias"]})
        return cls._finish(backbone, head, gradient_checkpointing, autocast)

    @classmethod
    def _finish(
        cls,
        backbone: PreTrainedModel,
        head: nn.Linear | None,
        gradient_checkpointing: bool,
        autocast: str,
    ) -> CriticModel:
        if gradient_checkpointing:
            enable_checkpointing(backbone)
        return cls(backbone, head, autocast)

    def save(self, directory: str | Path) -> Path:
        """Write the backbone (save_pretrained, safetensors) and the head
        (``value_head.safetensors``) into ``directory``; no pickle."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self.backbone.save_pretrained(str(directory))
        head = {k: v.detach().contiguous().cpu() for k, v in self.value_head.state_dict().items()}
        save_file(head, str(directory / VALUE_HEAD_FILE))
        return directory
