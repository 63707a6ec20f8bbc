"""Data-parallel strategies for one rank's trainable model: ``ddp`` (every rank holds the full
weights; gradients are summed over ranks before the optimizer step) and ``fsdp2``
(``torch.distributed.fsdp.fully_shard`` per decoder layer and at the root: parameters,
gradients and optimizer state are sharded; optional CPU offload and parameter dtype).

Both keep the workers' loss convention: every micro-batch loss is divided by counts taken over
the *global* mini-batch, so gradients are **summed** over ranks. FSDP2 averages its
reduce-scatter (a divide factor of 1 needs ``PREMUL_SUM``, which gloo lacks), so
``all_reduce_gradients`` multiplies its sharded gradients back by the world size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from creditrl.workers.distributed import is_distributed

__all__ = [
    "broadcast_parameters",
    "decoder_layers",
    "full_state_dict",
    "shard_model",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of a transformers model (any ``nn.ModuleList`` named
    ``layers`` or ``h``), the units FSDP2 shards one at a time."""
    blocks: list[nn.Module] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h"):
            blocks.extend(module)
    return blocks


def broadcast_parameters(model: nn.Module, src: int = 0) -> None:
    """Copy rank ``src``'s parameters and buffers to every rank (DDP does this at start)."""
    if not is_distributed():
        return
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor.data, src=src)


def shard_model(
    model: nn.Module, strategy: str, *, cpu_offload: bool = False, param_dtype: str = "float32"
) -> nn.Module:
    """Prepare ``model`` for ``strategy`` across the current process group (in place)."""
    if strategy not in ("ddp", "fsdp2"):
        raise ValueError(f"trainer.strategy must be 'ddp' or 'fsdp2', got {strategy!r}")
    if not is_distributed():
        return model
    if strategy == "ddp":
        broadcast_parameters(model)
        return model
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if param_dtype not in _DTYPES:
        raise ValueError(f"trainer.fsdp_param_dtype must be one of {sorted(_DTYPES)}")
    broadcast_parameters(model)
    kwargs = {
        "mp_policy": MixedPrecisionPolicy(
            param_dtype=_DTYPES[param_dtype], reduce_dtype=torch.float32
        )
    }
    if cpu_offload:  # pinned host memory needs an accelerator; on a CPU-only host it is a no-op
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=torch.cuda.is_available())
    for block in decoder_layers(model):
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's full (unsharded) state dict on CPU; a collective under fsdp2 (every rank
    must call it), a plain copy otherwise."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not is_distributed():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    options = StateDictOptions(full_state_dict=True, cpu_offload=False)
    return {k: v.detach().cpu() for k, v in get_model_state_dict(model, options=options).items()}
