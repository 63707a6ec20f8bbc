"""The rollout engine interface and its registry: ``rollout.engine`` names a registered engine.

An engine samples responses for prompts given as token ids and returns the sampled ids with
their log-probs; the rest of the code reads what it declares (``EngineTraits``), never its name.
Built in: ``hf`` (``creditrl.rollout.hf_engine``, transformers, CPU or GPU) and ``vllm``
(``creditrl.rollout.vllm_engine``, the optional GPU extra). A user engine registers itself
before the config is loaded (validation accepts registered names only)::

    from creditrl.rollout import EngineArgs, RolloutEngine, register_rollout_engine

    @register_rollout_engine("mine")
    class MyEngine(RolloutEngine):
        def __init__(self, args: EngineArgs) -> None: ...
        def generate(self, prompts, *, greedy=False, temperature=None, seed=None): ...
        def update_weights(self, named_tensors): ...

and runs with ``rollout.engine=mine``. A builder function ``fn(args) -> RolloutEngine`` may be
registered instead of a class, declaring its traits as keywords of the decorator. Every
capability a caller relies on is declared on ``RolloutEngine`` with a conservative default (see
its docstring) and read from there: nothing probes an engine for what it can do.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

import torch

from creditrl.batch import Batch
from creditrl.config.schema import RolloutConfig
from creditrl.errors import UserCodeError
from creditrl.rollout.engine_declarations import check_declarations
from creditrl.rollout.registries import (
    ROLLOUT_ENGINES,
    EngineTraits,
    check_rollout_engine,
    check_sampling_replay,
    engine_entry,
    engine_traits,
    kept_sets_recorded,
    register_rollout_engine,
    rollout_log_probs_are_actors,
    truncates,
)

if TYPE_CHECKING:
    pass

__all__ = [
    "ROLLOUT_ENGINES",
    "EngineArgs",
    "EngineTraits",
    "RolloutEngine",
    "build_rollout_engine",
    "check_rollout_engine",
    "check_sampling_replay",
    "engine_traits",
    "kept_sets_recorded",
    "register_rollout_engine",
    "rollout_log_probs_are_actors",
    "truncates",
]

E = TypeVar("E")
_REQUIRED = ("generate", "update_weights", "wake_up", "sleep", "generator")


@dataclass(frozen=True)
class EngineArgs:
    """What an engine is built from.

    - ``cfg``: the ``rollout`` section (sampling settings, ``max_response_length``, ...);
    - ``tokenizer``: the policy's tokenizer (pad and EOS ids);
    - ``model_path``: the policy's local Hugging Face directory (engines with their own copy
      of the weights load it from here);
    - ``model``: the policy's ``nn.Module``. An engine that ``samples_with_actor_module`` gets a
      full, unsharded module (a copy when the actor is sharded); others may only read it;
    - ``seed``: seeds the engine's ``generator``;
    - ``world_size``: data-parallel ranks that each build an engine (a torch.distributed job
      when > 1);
    - ``lora``: the policy carries LoRA adapters (pushed weights have PEFT names).
    """

    cfg: RolloutConfig
    tokenizer: Any
    model_path: str | Path
    model: torch.nn.Module | None = None
    seed: int = 0
    world_size: int = 1
    lora: bool = False


class RolloutEngine:
    """The interface every engine implements: subclass it (``build_rollout_engine`` refuses
    an engine that does not); what it does not override keeps the conservative defaults below.
    Token ids in, token ids out: nothing is decoded or re-encoded.

    Declarations of the class, read by the workers and the trainer instead of the engine's
    name (``engine_traits``):

    - ``samples_with_actor_module``: the engine samples with the ``nn.Module`` it was given, so
      the actor's updates are visible at once and nothing is pushed (unless the actor is
      sharded: then it gets a full copy, refreshed with ``update_weights``). False: it holds
      its own weights, pushed with ``update_weights`` at start and after every update;
    - ``exact_log_probs``: without top-k/top-p/min-p, ``rollout_log_probs`` are the actor's
      own log-probs at the same temperature (same weights, same numerics), so the trainer may
      use them as ``old_log_probs`` (``rollout_log_probs_are_actors``);
    - ``records_kept_set``: under top-k/top-p/min-p it writes ``rollout_kept_counts`` (each
      sampled token's kept-set size, ``creditrl.rollout.sampling``) when
      ``rollout.sampling_replay`` is on, so every log-prob stage replays the set it sampled
      from; an engine that does not is refused in one line with replay on
      (``check_sampling_replay``);
    - ``supports_lora``: it samples from a LoRA actor (``model.lora_rank > 0``);
    - ``weights_via``: how an async sampler's new weights reach it: ``"tensors"`` (the
      policy module is loaded in this process and its tensors pushed with ``update_weights``)
      or ``"folder"`` (``load_weights_folder`` reads the learner's published folder itself);
    - ``options``: the ``rollout.*`` settings only it reads (vLLM's memory share, say; one
      set for an engine that does not declare it draws a warning), and ``Option``s of its own
      (``creditrl.config.Option``), set as ``rollout.engine_kwargs.NAME`` and read from
      ``args.cfg.engine_kwargs`` (defaults filled in).

    Declarations of an engine (attributes and methods, defaults here): ``generator`` its
    ``torch.Generator`` (saved in checkpoints); ``model`` the module it samples with in this
    process (None: none); ``eos_token_ids`` the ids that end a response (None: the
    tokenizer's EOS); ``last_stats`` counts of the latest ``generate`` (``prefill_tokens``, ...;
    empty: none reported); ``keeps_turn_kv()`` whether it continues a sample's KV between agent
    turns (``generate_with_turn_cache``; False); ``capped(n)`` a view sampling at most ``n``
    tokens a call (itself: turns are cut after sampling); ``context_length()`` the most
    positions a sequence may take (the model's ``max_position_embeddings``; None: unknown);
    ``wake_up``/``sleep`` (no-ops: it never releases memory).
    """

    samples_with_actor_module: ClassVar[bool] = False
    exact_log_probs: ClassVar[bool] = False
    records_kept_set: ClassVar[bool] = False
    supports_lora: ClassVar[bool] = True
    weights_via: ClassVar[str] = "tensors"
    options: ClassVar[tuple[Any, ...]] = ()
    generator: torch.Generator
    model: torch.nn.Module | None = None
    eos_token_ids: Sequence[int] | torch.Tensor | None = None
    last_stats: Mapping[str, float] = MappingProxyType({})

    @classmethod
    def from_args(cls, args: EngineArgs) -> RolloutEngine:
        """The engine for ``args`` (``build_rollout_engine`` calls this); default ``cls(args)``."""
        return cls(args)  # type: ignore[call-arg]

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why the engine cannot run on this machine (one sentence), or None."""
        return None

    def generate(
        self,
        prompts: Batch,
        *,
        greedy: bool = False,
        temperature: float | None = None,
        seed: int | None = None,
    ) -> Batch:
        """One response per row of ``prompts``.

        In: left-padded ``input_ids`` / ``attention_mask`` (B, P) (``position_ids`` optional),
        optionally ``sample_seed`` (B,) int64: each row's own random stream. ``greedy`` (or
        temperature 0) takes the argmax; ``temperature`` overrides ``rollout.temperature``;
        ``seed`` re-seeds ``generator`` first.

        Out: a new Batch keeping the input's non-tensors, meta and other tensors, plus
        ``prompts`` (B, P) the input ids; ``responses`` (B, T) int64 right-padded with the pad
        id (T: the longest response; a response ends just after its EOS, which is kept);
        ``response_mask`` (B, T) 1 on response tokens; ``input_ids`` / ``attention_mask`` the
        prompt and response concatenated (B, P + T); ``position_ids`` = ``clamp(cumsum(
        attention_mask) - 1, 0)``; ``rollout_log_probs`` (B, T) float32, each sampled token's
        log-prob under the sampling distribution (temperature, top-k, top-p, min-p applied;
        greedy: the unscaled one), 0 on padding; with ``records_kept_set``, truncation on and
        ``rollout.sampling_replay``, ``rollout_kept_counts`` (B, T) int64. See
        ``creditrl.batch.FIELDS``.
        """
        raise NotImplementedError

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load the trainer's full (unsharded) tensors, by Hugging Face name; returns how many."""
        raise NotImplementedError

    def wake_up(self, tags: Sequence[str] | None = None) -> None:
        """Restore memory released by ``sleep``: all, or only ``tags`` (``"weights"``,
        ``"kv_cache"``). A no-op for engines that never sleep."""

    def sleep(self) -> None:
        """Release accelerator memory between rollouts. A no-op for engines that never sleep."""

    def keeps_turn_kv(self) -> bool:
        """Whether a sample's KV is kept between agent turns (``generate_with_turn_cache``)."""
        return False

    def capped(self, max_new_tokens: int) -> RolloutEngine:
        """This engine sampling at most ``max_new_tokens`` a call (default: itself)."""
        return self

    def context_length(self) -> int | None:
        """The most positions (prompt and response) a sequence may take, or None if unknown:
        ``max_position_embeddings`` of ``model``'s config."""
        config = getattr(self.model, "config", None)  # a Hugging Face module's, if it is one
        positions = None if config is None else config.to_dict().get("max_position_embeddings")
        return positions if isinstance(positions, int) else None

    def load_weights_folder(self, folder: Path) -> None:
        """Load the weights the learner published in ``folder`` (``creditrl.asynchronous.
        weights``: ``weights.safetensors`` and ``meta.json``, whose ``kind`` says full, merged
        or LoRA adapter tensors). Only an engine declaring ``weights_via="folder"`` is asked."""
        raise NotImplementedError(f"{type(self).__name__} declares weights_via='folder'")


def build_rollout_engine(args: EngineArgs) -> RolloutEngine:
    """The engine ``args.cfg.engine`` names, built from ``args`` (checked first with
    ``check_sampling_replay`` and ``check_rollout_engine``); UserCodeError if what it builds
    lacks part of the interface."""
    name = args.cfg.engine
    check_sampling_replay(args.cfg)
    check_rollout_engine(name)
    entry = engine_entry(name)
    subclass = isinstance(entry, type) and issubclass(entry, RolloutEngine)
    builder = entry.from_args if subclass else entry
    engine = builder(args)
    missing = [attr for attr in _REQUIRED if not hasattr(engine, attr)]
    if missing or not isinstance(engine, RolloutEngine):
        lacks = f"lacks {missing}" if missing else "is not a creditrl.rollout.RolloutEngine"
        raise UserCodeError(
            f"rollout.engine={name}: the engine it builds ({type(engine).__name__}) {lacks}; "
            "subclass creditrl.rollout.RolloutEngine (its declarations' defaults) and "
            "implement generate, update_weights and a torch.Generator `generator`"
        )
    check_declarations(engine, name, args.cfg.max_response_length, RolloutEngine)
    return engine
