"""What a weight channel carries: a model's tensors by kind, their snapshot, their file form,
and loading them into a model.

A publication is ``(kind, tensors)`` (``publishable_state``): ``full`` (a plain model's state
dict), ``merged`` (a LoRA model's base weights with each adapter's delta W + (alpha/r) B A
added: load it into a plain model) or ``adapter`` (the LoRA adapter tensors alone: load it into
a model with the same LoRA wrapping); ``apply_state`` loads one, refusing a kind that does not
fit the model. Tied tensors (``lm_head.weight`` = ``model.embed_tokens.weight``) are stored
once (``snapshot_tensors``); their aliases are recorded in the safetensors metadata.
safetensors + JSON only.

A LoRA head tied to the input embeddings (``model.target_modules`` with ``lm_head`` on a model
with ``tie_word_embeddings``) merges into a head that is no longer the embeddings: the merged
state holds two different tensors under the tied names, and ``apply_state`` unties them in the
model it loads into (``untie``) rather than letting one overwrite the other; ``merged_model``
unties the same way before peft merges in place (export, a run's actor as teacher).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

__all__ = [
    "LORA_SYNC",
    "apply_state",
    "distinct_tensors",
    "is_peft",
    "load_tensors",
    "merged_model",
    "merged_state_dict",
    "publishable_state",
    "save_tensors",
    "snapshot_tensors",
    "tied_groups",
    "untie",
]

LORA_SYNC = ("merged", "adapter")


def is_peft(model: torch.nn.Module) -> bool:
    """True for a peft (LoRA) model."""
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config")


@torch.no_grad()
def merged_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The plain-model state dict of a LoRA (peft) model with its active adapters merged:
    W' = W + get_delta_weight = W + (alpha / r) B A for each adapted linear. The training
    model is not modified. An adapted weight tied to another (a LoRA head tied to the
    embeddings) is merged under its own name only: the other name keeps the unmerged tensor,
    so a tied plain model must be untied to hold both (``apply_state`` does)."""
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    out: dict[str, torch.Tensor] = {}
    for key, value in base.state_dict().items():
        if ".lora_" not in key:
            out[key.replace(".base_layer.", ".")] = value.detach()
    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    weight = f"{name}.weight"
                    out[weight] = out[weight] + module.get_delta_weight(adapter).to(out[weight])
    return out


def publishable_state(model: torch.nn.Module, lora_sync: str) -> tuple[str, dict[str, Any]]:
    """(kind, tensors) to publish for ``model``: ``full`` for a plain model; for a peft model
    ``merged`` or ``adapter`` as ``lora_sync`` says."""
    if not is_peft(model):
        return "full", {k: v.detach() for k, v in model.state_dict().items()}
    if lora_sync not in LORA_SYNC:
        raise ValueError(f"asynchronous.lora_sync must be one of {LORA_SYNC}, got {lora_sync!r}")
    if lora_sync == "merged":
        return "merged", merged_state_dict(model)
    from peft import get_peft_model_state_dict

    return "adapter", {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}


@torch.no_grad()
def apply_state(model: torch.nn.Module, kind: str, tensors: dict[str, Any], where: Any) -> None:
    """Load a publication of ``kind`` into ``model`` (strict); ``where`` (its folder, or what
    else it came from) names it in the errors: adapters into a model without LoRA, full or
    merged weights into a LoRA model, adapter keys the model does not have."""
    if kind == "adapter":
        if not is_peft(model):
            raise TypeError(f"{where} holds LoRA adapters but the sampler model has no LoRA")
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, tensors)
        if result.unexpected_keys:
            raise KeyError(f"{where}: adapter keys unknown here: {result.unexpected_keys}")
        return
    if is_peft(model):
        raise TypeError(f"{where} holds {kind} weights: load them into a plain model")
    for names in tied_groups(model):
        given = [tensors[n] for n in names if n in tensors]
        if any(not torch.equal(given[0], t.to(given[0].device)) for t in given[1:]):
            untie(model, names[1:])
    model.load_state_dict(tensors, strict=True)


def tied_groups(model: torch.nn.Module) -> list[list[str]]:
    """The names of each parameter ``model`` holds under more than one name (tied weights:
    ``model.embed_tokens.weight`` and ``lm_head.weight``), in ``named_parameters`` order."""
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return [names for names in groups.values() if len(names) > 1]


@torch.no_grad()
def untie(model: torch.nn.Module, names: list[str]) -> None:
    """Give each parameter ``names`` lists a copy of its own (same values, dtype, device and
    ``requires_grad``), and set ``config.tie_word_embeddings`` to False where ``model`` has
    one, so that transformers (``tie_weights``, ``save_pretrained``, loading) keeps them
    apart."""
    for name in names:
        owner_name, _, attr = name.rpartition(".")
        owner = model.get_submodule(owner_name)
        param = getattr(owner, attr)
        setattr(owner, attr, torch.nn.Parameter(param.detach().clone(), param.requires_grad))
    config = getattr(model, "config", None)
    if names and getattr(config, "tie_word_embeddings", False):
        config.tie_word_embeddings = False


def merged_model(model: torch.nn.Module) -> torch.nn.Module:
    """A plain model with the LoRA adapters of ``model`` (a peft model; any other module is
    returned as it is) merged into its linears (peft's ``merge_and_unload``, in place: the
    peft wrapping is consumed). An adapted weight tied to another (a LoRA head tied to the
    embeddings) is untied first, so the merge changes the head only."""
    if not is_peft(model):
        return model
    from peft.tuners.lora import LoraLayer

    base = model.get_base_model()
    adapted = {
        f"{name}.base_layer.weight"
        for name, module in base.named_modules()
        if isinstance(module, LoraLayer)
    }
    for names in tied_groups(base):
        untie(base, [n for n in names if n in adapted][: len(names) - 1])
    return model.merge_and_unload()


def distinct_tensors(
    tensors: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(the tensors, each memory once, uncopied; aliases): of tensors sharing memory (same
    data pointer, shape and dtype) the first name is kept and the others recorded as
    ``{alias: kept name}``."""
    kept: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple[int, tuple[int, ...], torch.dtype], str] = {}
    for key, value in tensors.items():
        ident = (value.data_ptr(), tuple(value.shape), value.dtype)
        if ident in seen:
            aliases[key] = seen[ident]
            continue
        seen[ident] = key
        kept[key] = value.detach()
    return kept, aliases


def snapshot_tensors(
    tensors: dict[str, torch.Tensor],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(fresh contiguous CPU copies, aliases): tensors sharing memory are copied once and the
    other names recorded as ``{alias: stored name}`` (``distinct_tensors``)."""
    kept, aliases = distinct_tensors(tensors)
    return {k: v.to("cpu", copy=True).contiguous() for k, v in kept.items()}, aliases


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write ``tensors`` as safetensors, tensors that share memory once (aliases in the
    metadata)."""
    stored, aliases = snapshot_tensors(tensors)
    save_file(stored, str(path), metadata={"aliases": json.dumps(aliases)})


def load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Inverse of ``save_tensors`` (aliases point at the same tensor)."""
    tensors = load_file(str(path))
    with safe_open(str(path), framework="pt") as f:
        aliases = json.loads((f.metadata() or {}).get("aliases", "{}"))
    for alias, target in aliases.items():
        tensors[alias] = tensors[target]
    return tensors
