"""One trainable's checkpoint files (model, optimizer, scheduler) for any number of ranks.

Two formats, both safetensors + JSON (no pickle), both loadable by any number of ranks:

- ``full``: rank 0 writes ``<name>.model.safetensors`` and ``<name>.optim.safetensors`` with
  unsharded tensors keyed by parameter name (gathered from the shards under fsdp2);
- ``sharded``: every rank writes ``<name>.model.rank<r>.safetensors`` (and ``.optim``) holding
  its local shards (fsdp2 shards dimension 0); loading concatenates them in rank order back
  to full tensors and re-shards for the current world size. Under ddp the weights are
  replicated, so rank 0 writes one shard.

Tensors are written from the CPU and read onto it, then copied into the models and optimizer
wherever they live (``trainer.device``): a run checkpointed on the CPU resumes on CUDA and back.

Tied weights (the LM head sharing the embedding) are stored once; the other names are
recorded as aliases in the JSON meta.

Before anything is loaded, ``checkpoint_mismatch`` compares the checkpoint with the models from
the safetensors headers and the JSON meta alone: every tensor name and (full, gathered) shape,
the optimizer state's parameter names and shapes, and the meta's types. It names the first
difference (written for another model, or rewritten under a recomputed manifest), so a
checkpoint that does not fit is refused whole instead of half loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from creditrl.errors import DataError
from creditrl.workers.distributed import is_distributed, rank, world_size

__all__ = [
    "CheckpointMismatchError",
    "checkpoint_mismatch",
    "load_trainable",
    "save_trainable",
    "trainable_mismatch",
]

MAX_RANKS = 1 << 16  # a sharded checkpoint's world_size beyond this is not a real one


class CheckpointMismatchError(DataError):
    """A checkpoint whose tensors do not fit the models (names the first difference)."""


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
        return [directory / f"{name}.{part}.rank{r}.safetensors" for r in range(meta["world_size"])]
    return [directory / f"{name}.{part}.safetensors"]


Shapes = dict[str, list[int]]


def _quoted(key: str) -> str:
    """A tensor name read from a file, quoted and escaped (a header may hold any text)."""
    return repr(key[:120])


def _str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _str_map(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


def _optim_meta_ok(optim: Any) -> bool:
    return (
        isinstance(optim, dict)
        and _str_map(optim.get("aliases"))
        and _str_list(optim.get("sharded"))
        and isinstance(optim.get("scalars"), dict)
        and all(isinstance(v, dict) for v in optim["scalars"].values())
        and isinstance(optim.get("param_groups"), list)
        and all(isinstance(g, dict) and _str_list(g.get("params")) for g in optim["param_groups"])
    )


def _meta_problem(name: str, meta: Any) -> str | None:
    """What in ``name``'s JSON meta (kept in state.json) has the wrong type, or None."""
    where = f"state.json: part {name!r}"
    if not isinstance(meta, dict) or meta.get("format") not in ("full", "sharded"):
        return f"{where} has no format 'full' or 'sharded'"
    ranks = meta.get("world_size")
    if meta["format"] == "sharded" and not (isinstance(ranks, int) and 1 <= ranks <= MAX_RANKS):
        return f"{where} has world_size {str(ranks)[:20]}, not 1 to {MAX_RANKS}"
    if not _str_map(meta.get("model_aliases")) or not _str_list(meta.get("model_sharded")):
        return f"{where} lacks model_aliases or model_sharded"
    if meta.get("optim") is not None and not _optim_meta_ok(meta["optim"]):
        return f"{where} has a malformed optim entry"
    if not isinstance(meta.get("scheduler"), dict | None):
        return f"{where} has a scheduler state that is not a JSON object"
    return None


def _part_shapes(
    directory: Path, name: str, part: str, meta: dict[str, Any], aliases: dict, sharded: list
) -> tuple[str, Shapes] | str:
    """(the files' label, each tensor's full shape as loading builds it: shards stacked along
    dimension 0, aliases resolved), read from the safetensors headers; or why that fails."""
    files = _files(directory, name, part, meta)
    label = files[0].name if len(files) == 1 else f"{name}.{part}.rank*.safetensors"
    per_file = []
    for path in files:
        if not path.is_file():
            return f"{path.name}: missing"
        try:
            with safe_open(str(path), framework="pt") as f:
                names = f.keys()  # a safe_open handle is not iterable
                per_file.append({k: list(f.get_slice(k).get_shape()) for k in names})
        except Exception as err:  # safetensors raises its own error types for a bad header
            return f"{path.name}: unreadable safetensors header ({str(err).splitlines()[0][:120]})"
    stacked = set(sharded)
    shapes: Shapes = {}
    for key, shape in per_file[0].items():
        if key in stacked:
            parts = [found.get(key) for found in per_file]
            if not shape or any(not p or p[1:] != shape[1:] for p in parts):
                return f"{label}: the shards of {_quoted(key)} do not stack"
            shape = [sum(p[0] for p in parts), *shape[1:]]
        shapes[key] = shape
    for alias, target in aliases.items():
        if target not in shapes:
            return f"{label}: alias {_quoted(alias)} names {_quoted(target)}, which it lacks"
        shapes[alias] = shapes[target]
    return label, shapes


def _shapes_differ(label: str, key: str, stored: list[int], model: list[int]) -> str:
    return f"{label}: {_quoted(key)} has shape {stored} in the checkpoint, {model} in the model"


def _difference(label: str, found: Shapes, expected: Shapes) -> str | None:
    """The first tensor whose name or shape differs: the model's order, then extra names."""
    for key, shape in expected.items():
        if key not in found:
            return f"{label}: {_quoted(key)} is missing (shape {shape} in the model)"
        if found[key] != shape:
            return _shapes_differ(label, key, found[key], shape)
    extra = next((key for key in found if key not in expected), None)
    if extra is not None:
        return f"{label}: {_quoted(extra)} (shape {found[extra]}) is not in the model"
    return None


def _optim_difference(
    label: str,
    found: Shapes,
    optim: dict[str, Any],
    params: Shapes,
    optimizer: torch.optim.Optimizer,
) -> str | None:
    """The first optimizer state entry that names no parameter of the model or has another
    shape than its parameter; or parameter groups of other sizes."""
    for key, shape in found.items():
        fqn, sep, _ = key.rpartition("::")
        if not sep or fqn not in params:
            return f"{label}: {_quoted(key)} is the state of no parameter of the model"
        if shape and shape != params[fqn]:
            return _shapes_differ(label, key, shape, params[fqn])
    unknown = [fqn for fqn in optim["scalars"] if fqn not in params]
    unknown += [p for group in optim["param_groups"] for p in group["params"] if p not in params]
    if unknown:
        return (
            f"state.json: optimizer state for {_quoted(unknown[0])}, not a parameter of the model"
        )
    sizes = [len(group["params"]) for group in optim["param_groups"]]
    ours = [len(group["params"]) for group in optimizer.param_groups]
    if sizes != ours:
        return f"state.json: optimizer parameter groups of {sizes} parameters, the model's {ours}"
    return None


def trainable_mismatch(
    directory: Path,
    name: str,
    meta: Any,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
) -> str | None:
    """Why ``name``'s files in ``directory`` cannot be loaded into ``model`` and ``optimizer``
    ("file: problem": a malformed meta, a missing file, the first tensor whose name or full
    shape differs), or None. Reads only the JSON meta and the safetensors headers."""
    problem = _meta_problem(name, meta)
    if problem is not None:
        return problem
    params = {k: list(v.shape) for k, v in get_model_state_dict(model).items()}
    found = _part_shapes(
        directory, name, "model", meta, meta["model_aliases"], meta["model_sharded"]
    )
    if isinstance(found, str):
        return found
    problem = _difference(*found, params)
    if problem is not None or optimizer is None or meta.get("optim") is None:
        return problem
    optim = meta["optim"]
    found = _part_shapes(directory, name, "optim", meta, optim["aliases"], optim["sharded"])
    if isinstance(found, str):
        return found
    return _optim_difference(*found, optim, params, optimizer)


def checkpoint_mismatch(directory: Path, meta: Any, trainables: dict[str, tuple]) -> str | None:
    """``trainable_mismatch`` for each ``name -> (model, optimizer, scheduler)``, the first
    problem found; a checkpoint without one of them does not fit either."""
    if not isinstance(meta, dict):
        return "state.json: its parts are not a JSON object"
    for name, (model, optimizer, _) in trainables.items():
        if name not in meta:
            return f"state.json: no part {name!r} (the checkpoint was written without it)"
        problem = trainable_mismatch(directory, name, meta[name], model, optimizer)
        if problem is not None:
            return problem
    return None


def load_trainable(
    directory: Path,
    name: str,
    meta: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any,
) -> None:
    """Restore what ``save_trainable`` wrote, for the current number of ranks (collective).
    Raises ``CheckpointMismatchError``, having loaded nothing, when it does not fit."""
    problem = trainable_mismatch(directory, name, meta, model, optimizer)
    if problem is not None:
        raise CheckpointMismatchError(f"checkpoint {directory} does not fit the model: {problem}")
    files = _files(directory, name, "model", meta)
    model_state = _gather_shards(files, meta["model_aliases"], meta["model_sharded"])
    options = StateDictOptions(full_state_dict=True, strict=True)
    set_model_state_dict(model, model_state, options=options)
    if optimizer is None or meta.get("optim") is None:
        return
    optim_meta = meta["optim"]
    optim_files = _files(directory, name, "optim", meta)
    tensors = _gather_shards(optim_files, optim_meta["aliases"], optim_meta["sharded"])
    state = _unflatten_optimizer(tensors, optim_meta)
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=options)
    if scheduler is not None and meta.get("scheduler") is not None:
        scheduler.load_state_dict(meta["scheduler"])
