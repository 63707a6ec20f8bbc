"""A plain copy of a LoRA (peft) policy with its adapters merged, to sample with.

A peft model computes each adapted linear as ``W x + s B (A x)``: two extra small products per
linear, and a module tree (``lora.Linear`` around ``nn.Linear``) that the fast decode paths do
not take: ``rollout.llama_decode.LlamaDecoder`` wants a plain ``LlamaForCausalLM`` and
``cpu_kernels.weight_major_linears`` patches plain ``nn.Linear`` modules only. The HF engine
therefore samples a LoRA actor from ``MergedCopy``: a copy of the base model (no peft) whose
adapted linears hold ``W' = W + s B A`` (peft's ``get_delta_weight``, summed over the active
adapters), so a decode step is the full model's and every fast path applies.

Merged once per weight version: ``refreshed(model)`` recomputes a merged weight only when a
tensor it is made of changed since the last merge, and copies an unadapted tensor only when it
changed; two calls with no update between them merge once (``merges`` counts the refreshes
that changed the copy, the first build included). A change is seen by a tensor's storage
(``data_ptr``) and version counter (``load_state_dict``, ``copy_``, non-fused optimizers), and,
for the adapters and any trainable tensor, by comparing its values with a snapshot of the last
merge: a fused AdamW step (``torch._fused_adamw_``, creditrl's default) writes parameters
without bumping their version counter. Every write is an in-place ``copy_``, so the copy's
storage never moves and CUDA graphs captured over it (``rollout.cuda_graph``, keyed on
``data_ptr``s) stay valid, as with ``rollout.sampler_copy``.

``dtype`` (None: the model's) rounds the copy once, after the merge computed in float32
(``rollout.engine_kwargs.sample_dtype=bfloat16`` with LoRA: merge, then bf16).

Its log-probs equal the adapter model's to float rounding, not bit for bit: ``W' x`` rounds
differently from ``W x + s B (A x)``. In float32 that is the size of the gap the engine's own
KV-cache decode already has against the teacher-forced forward (``tests/test_lora_sampling.py``
measures both on the tiny model), so a float32 LoRA run reuses them as ``old_log_probs`` exactly
as a full-model run does (``pipeline.step.rollout_log_probs_reusable``); under bf16 autocast,
or with the bf16 copy, ``old_log_probs`` are recomputed by the update's forward, as for any
model. A model this cannot merge exactly (``merge_unsupported``: adapters on other layer kinds,
DoRA and other variants, LoRA biases, adapters merged in place or disabled, non-LoRA peft
methods, accelerate hooks) is sampled as it is, through peft.

The copy costs one more set of the base weights in memory (in ``dtype``).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["MergedCopy", "is_lora_model", "merge_unsupported"]


def is_lora_model(model: nn.Module) -> bool:
    """True for a peft model (``apply_lora``)."""
    return hasattr(model, "get_base_model") and hasattr(model, "peft_config")


def _lora_layers(base: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    from peft.tuners.lora import LoraLayer

    for name, module in base.named_modules():
        if isinstance(module, LoraLayer):
            yield name, module


def merge_unsupported(model: nn.Module) -> str | None:
    """None when ``model`` is a peft LoRA model whose active adapters merge exactly into plain
    linears (``W + s B A``), else why not (one line)."""
    if not is_lora_model(model):
        return "it is not a peft model"
    from peft import PeftType
    from peft.tuners.lora import Linear as LoraLinear

    peft_type = getattr(getattr(model, "active_peft_config", None), "peft_type", None)
    if peft_type != PeftType.LORA:
        return f"its peft method is {peft_type}, not LoRA"
    base = model.get_base_model()
    if any(hasattr(m, "_hf_hook") for m in base.modules()):
        return "it has accelerate hooks (offloaded or dispatched weights)"
    inside = {id(m) for _, layer in _lora_layers(base) for m in layer.modules()}
    for name, module in base.named_modules():
        if type(module).__module__.startswith("peft.") and id(module) not in inside:
            return f"{name} is peft's {type(module).__name__} (only LoRA layers are merged)"
    for name, layer in _lora_layers(base):
        if type(layer) is not LoraLinear or type(layer.get_base_layer()) is not nn.Linear:
            return f"{name} is a {type(layer).__name__} (only LoRA on nn.Linear is merged)"
        if layer.merged:
            return f"{name} has adapters merged in place"
        if layer.disable_adapters:
            return f"{name} has its adapters disabled"
        for adapter in _active(layer):
            variant = getattr(layer, "lora_variant", {})
            if adapter in variant or getattr(layer, "use_dora", {}).get(adapter, False):
                return f"{name}'s adapter {adapter!r} is a variant (e.g. DoRA)"
            if getattr(layer, "lora_bias", {}).get(adapter, False):
                return f"{name}'s adapter {adapter!r} has a LoRA bias"
    return None


def _active(layer: nn.Module) -> list[str]:
    return [a for a in layer.active_adapters if a in layer.lora_A]


def _stamp(tensor: torch.Tensor) -> tuple:
    """Where ``tensor`` lives and how often it was written in place (None: not tracked)."""
    try:
        version = tensor._version
    except RuntimeError:  # an inference tensor: no version counter
        version = None
    return (tensor.data_ptr(), version, tensor.dtype, tuple(tensor.shape))


@dataclass
class _Mark:
    """A source tensor as it was at the last refresh: its stamp and, when ``by_value``, a copy
    of its values."""

    stamp: tuple
    values: torch.Tensor | None = None

    @classmethod
    def of(cls, tensor: torch.Tensor, by_value: bool) -> _Mark:
        by_value = by_value or _stamp(tensor)[1] is None
        return cls(_stamp(tensor), tensor.detach().clone() if by_value else None)

    def changed(self, tensor: torch.Tensor) -> bool:
        if _stamp(tensor) != self.stamp:
            return True
        return self.values is not None and not torch.equal(tensor, self.values)


@dataclass
class _Plain:
    """An unadapted tensor: ``owner``'s ``attr`` in the source, ``target`` in the copy."""

    owner: nn.Module
    attr: str
    target: torch.Tensor
    mark: _Mark | None = None

    def source(self) -> torch.Tensor:
        return getattr(self.owner, self.attr)

    def refresh(self) -> bool:
        tensor = self.source()
        watch = tensor.requires_grad
        if self.mark is not None and not self.mark.changed(tensor):
            return False
        self.target.copy_(tensor)
        self.mark = _Mark.of(tensor, watch)
        return True


@dataclass
class _Merged:
    """An adapted linear: ``layer`` (peft's ``lora.Linear``) in the source, the merged weight
    ``target`` in the copy."""

    layer: nn.Module
    target: torch.Tensor
    marks: dict[str, _Mark] = field(default_factory=dict)
    key: tuple = ()

    def sources(self) -> dict[str, tuple[torch.Tensor, bool]]:
        """The tensors the merged weight is made of, and whether each is watched by value."""
        base = self.layer.get_base_layer().weight
        out = {"W": (base, base.requires_grad)}
        for adapter in _active(self.layer):
            out[f"A/{adapter}"] = (self.layer.lora_A[adapter].weight, True)
            out[f"B/{adapter}"] = (self.layer.lora_B[adapter].weight, True)
        return out

    def refresh(self) -> bool:
        layer = self.layer
        key = tuple((a, float(layer.scaling[a]), layer.fan_in_fan_out) for a in _active(layer))
        sources = self.sources()
        if (
            key == self.key
            and sources.keys() == self.marks.keys()
            and not any(self.marks[k].changed(t) for k, (t, _) in sources.items())
        ):
            return False
        weight = sources["W"][0]
        work = torch.float32 if weight.dtype in (torch.bfloat16, torch.float16) else weight.dtype
        merged = weight.detach().to(work, copy=True)
        for adapter in _active(layer):
            merged.add_(layer.get_delta_weight(adapter).to(work))
        self.target.copy_(merged)
        self.key = key
        self.marks = {k: _Mark.of(t, by_value) for k, (t, by_value) in sources.items()}
        return True


class MergedCopy:
    """A plain copy of a peft LoRA model with its active adapters merged (see the module
    docstring), built at the first ``refreshed`` and refreshed in place at later ones; a
    different model makes a new copy. ``merges`` counts the refreshes that changed it."""

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        self.dtype = dtype
        self.source: nn.Module | None = None
        self.module: nn.Module | None = None
        self.merges = 0
        self._entries: list[_Plain | _Merged] = []
        self._device: torch.device | None = None

    # outside inference mode (the copy's tensors stay writable in later calls made outside
    # it), then without grad (inference_mode(False) turns grad mode on)
    @torch.inference_mode(False)
    @torch.no_grad()
    def refreshed(self, model: nn.Module) -> nn.Module | None:
        """The copy holding ``model``'s current weights merged (None when ``model`` cannot be
        merged exactly: ``merge_unsupported``); a new copy when ``model`` is another module or
        has moved to another device."""
        if merge_unsupported(model) is not None:
            return None
        if self.module is None or self.source is not model or self._device != _device_of(model):
            self._build(model)
        changed = False
        for entry in self._entries:
            changed |= entry.refresh()
        if changed:
            self.merges += 1
        return self.module

    def _build(self, model: nn.Module) -> None:
        """The copy of ``model``'s base model with each ``lora.Linear`` replaced by its base
        ``nn.Linear``, whose weight becomes a tensor of its own (a LoRA head tied to the input
        embeddings is untied in the copy); the entries that refresh it."""
        base = model.get_base_model()
        layers = dict(_lora_layers(base))
        module = copy.deepcopy(base)
        for name in layers:
            parent, _, child = name.rpartition(".")
            owner = module.get_submodule(parent)
            setattr(owner, child, owner.get_submodule(child).get_base_layer())
        module.__dict__.pop("peft_config", None)  # peft's mark on its base model
        if self.dtype is not None:
            module = module.to(self.dtype)
        module.eval().requires_grad_(False)
        entries: list[_Plain | _Merged] = []
        for name, layer in layers.items():
            linear = module.get_submodule(name)
            weight = nn.Parameter(torch.empty_like(linear.weight), requires_grad=False)
            linear.weight = weight
            entries.append(_Merged(layer, weight))
        merged = {f"{name}.base_layer.weight" for name in layers}
        targets = dict(module.named_parameters(remove_duplicate=False))
        targets.update(module.named_buffers(remove_duplicate=False))
        seen: set[int] = set()
        for name, owner, attr in _named_tensors(base):
            if ".lora_" in name or name in merged:
                continue
            target = targets[name.replace(".base_layer.", ".")]
            if id(target) in seen:  # a tied tensor: copied once
                continue
            seen.add(id(target))
            entries.append(_Plain(owner, attr, target))
        for param in module.parameters():
            param.grad = None
        self.source, self.module, self._entries = model, module, entries
        self._device = _device_of(model)


def _device_of(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _named_tensors(module: nn.Module) -> Iterator[tuple[str, nn.Module, str]]:
    """(full name, owning module, attribute) of every parameter and buffer, tied ones under
    each of their names."""
    for prefix, owner in module.named_modules(remove_duplicate=False):
        for attr in (*owner._parameters, *owner._buffers):
            if getattr(owner, attr) is not None:
                yield (f"{prefix}.{attr}" if prefix else attr), owner, attr
