"""One trainable's checkpoint files (model, optimizer, scheduler) for any number of ranks.

Two formats, both safetensors + JSON (no pickle), both loadable by any number of ranks:

- ``full``: rank 0 writes ``<name>.model.safetensors`` and ``<name>.optim.safetensors`` with
  unsharded tensors keyed by parameter name (gathered from the shards under fsdp2);
- ``sharded``: every rank writes ``<name>.model.rank<r>.safetensors`` (and ``.optim``) holding
  its local shards (fsdp2 shards dimension 0); loading concatenates them in rank order back
  to full tensors and re-shards for the current world size. Under ddp the weights are
  replicated, so rank 0 writes one shard.

Tied weights (the LM head sharing the embedding) are stored once; the other names are
recorded as aliases in the JSON meta.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from creditrl.workers.distributed import is_distributed, rank, world_size

__all__ = ["load_trainable", "save_trainable"]


def _local(value: Any) -> Any:
    """A DTensor's local shard; other values unchanged."""
    return value.to_local() if hasattr(value, "to_local") else value


def _flatten_optimizer(state: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, entry in state["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{fqn}::{key}"] = value
            else:
                scalars.setdefault(fqn, {})[key] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _unflatten_optimizer(tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> dict:
    state: dict[str, dict[str, Any]] = {}
    for name, value in tensors.items():
        fqn, key = name.rsplit("::", 1)
        state.setdefault(fqn, {})[key] = value
    for fqn, entry in meta["scalars"].items():
        state.setdefault(fqn, {}).update(entry)
    return {"state": state, "param_groups": meta["param_groups"]}


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> dict[str, str]:
    """Write tensors (deduplicating shared storage); returns {alias: stored name}."""
    stored: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, int, tuple[int, ...]], str] = {}
    for name, value in tensors.items():
        value = value.detach().cpu()
        key = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape))
        if value.numel() > 0 and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        stored[name] = value.contiguous()
    save_file(stored, str(path))
    return aliases


def _load_tensors(path: Path, aliases: dict[str, str]) -> dict[str, torch.Tensor]:
    tensors = load_file(str(path))
    tensors.update({alias: tensors[name] for alias, name in aliases.items()})
    return tensors


def _gather_shards(
    files: list[Path], aliases: dict[str, str], sharded: list[str]
) -> dict[str, torch.Tensor]:
    """Full tensors from per-rank shard files: the ``sharded`` names are concatenated along
    dimension 0 in rank order; the others (replicated) are taken from the first file."""
    parts = [_load_tensors(f, aliases) for f in files]
    names = set(sharded)
    return {
        key: torch.cat([p[key] for p in parts], dim=0) if key in names else value
        for key, value in parts[0].items()
    }


def _is_sharded(value: Any) -> bool:
    return hasattr(value, "to_local")


def save_trainable(
    directory: Path,
    name: str,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
    fmt: str = "full",
) -> dict[str, Any]:
    """Write ``name``'s files into ``directory`` (a collective: every rank calls it); returns
    the JSON meta to keep beside them."""
    if fmt not in ("full", "sharded"):
        raise ValueError(f"trainer.checkpoint_format must be 'full' or 'sharded', got {fmt!r}")
    sharded = fmt == "sharded" and is_distributed()
    options = StateDictOptions(full_state_dict=not sharded, cpu_offload=not sharded)
    raw_model = get_model_state_dict(model, options=options)
    model_sharded = [k for k, v in raw_model.items() if _is_sharded(v)]
    model_state = {k: _local(v) for k, v in raw_model.items()}
    optim_state, optim_sharded = None, []
    if optimizer is not None:
        optim_state = get_optimizer_state_dict(model, optimizer, options=options)
        optim_state.setdefault("state", {})  # empty off rank 0 when gathered to rank 0
        optim_sharded = [
            f"{fqn}::{k}"
            for fqn, entry in optim_state["state"].items()
            for k, v in entry.items()
            if _is_sharded(v)
        ]
        optim_state["state"] = {
            fqn: {k: _local(v) for k, v in entry.items()}
            for fqn, entry in optim_state["state"].items()
        }
    writes = sharded or rank() == 0
    suffix = f".rank{rank()}" if sharded else ""
    meta: dict[str, Any] = {"format": "sharded" if sharded else "full", "world_size": world_size()}
    if writes:
        meta["model_aliases"] = _save_tensors(
            model_state, directory / f"{name}.model{suffix}.safetensors"
        )
        meta["model_sharded"] = model_sharded
        if optim_state is not None:
            tensors, optim_meta = _flatten_optimizer(optim_state)
            optim_meta["aliases"] = _save_tensors(
                tensors, directory / f"{name}.optim{suffix}.safetensors"
            )
            optim_meta["sharded"] = optim_sharded
            meta["optim"] = optim_meta
            meta["scheduler"] = scheduler.state_dict() if scheduler is not None else None
    return meta


def _files(directory: Path, name: str, part: str, meta: dict[str, Any]) -> list[Path]:
    if meta["format"] == "sharded":
        files = [
            directory / f"{name}.{part}.rank{r}.safetensors" for r in range(meta["world_size"])
        ]
    else:
        files = [directory / f"{name}.{part}.safetensors"]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"checkpoint {directory} lacks {name!r} files: {missing}")
    return files


def load_trainable(
    directory: Path,
    name: str,
    meta: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
) -> None:
    """Restore what ``save_trainable`` wrote, for the current number of ranks (collective)."""
    files = _files(directory, name, "model", meta)
    model_state = _gather_shards(files, meta["model_aliases"], meta["model_sharded"])
    options = StateDictOptions(full_state_dict=True, strict=True)
    set_model_state_dict(model, model_state, options=options)
    if optimizer is None or "optim" not in meta:
        return
    optim_meta = meta["optim"]
    optim_files = _files(directory, name, "optim", meta)
    tensors = _gather_shards(optim_files, optim_meta["aliases"], optim_meta["sharded"])
    state = _unflatten_optimizer(tensors, optim_meta)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=options)
    if scheduler is not None and meta.get("scheduler") is not None:
        scheduler.load_state_dict(meta["scheduler"])
