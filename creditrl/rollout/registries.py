"""The rollout engines' registry: ``rollout.engine`` names an entry, declared here by the dotted
path of its class with the traits it declares (``EngineTraits``), so a config is checked
without importing torch or the engine; the class is imported when an engine is built.

Built in: ``hf`` (``creditrl.rollout.hf_engine``, transformers, CPU or GPU) and ``vllm``
(``creditrl.rollout.vllm_engine``, the optional GPU extra). A user engine registers itself
with ``register_rollout_engine`` (``creditrl.rollout.engine`` says how). A test pins that the
traits declared here are the built-in classes' own declarations.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from creditrl.config.options import Option
from creditrl.config.schema import RolloutConfig
from creditrl.errors import ConfigError
from creditrl.registry import Registry
from creditrl.rollout.strategies import strategy_traits

if TYPE_CHECKING:
    from creditrl.config import Config

__all__ = [
    "DECODE_CACHE",
    "ROLLOUT_ENGINES",
    "SAMPLE_DTYPE",
    "WEIGHT_TRANSFERS",
    "EngineTraits",
    "check_rollout_engine",
    "check_sampling_replay",
    "engine_entry",
    "engine_traits",
    "kept_sets_recorded",
    "register_rollout_engine",
    "rollout_log_probs_are_actors",
    "truncates",
    "vllm_unavailable_reason",
]

E = TypeVar("E")
ROLLOUT_ENGINES: Registry = Registry("rollout engine")
WEIGHT_TRANSFERS = ("tensors", "folder")

DECODE_CACHE = Option(
    "decode_cache",
    "auto",
    "'static': decode from a preallocated KV cache, captured as a CUDA graph on CUDA (eager on "
    "the CPU); 'dynamic': finished rows leave the cache; 'auto': static for CUDA models that "
    "allow it. 'static' with agent.keep_kv_cache is refused",
    choices=("auto", "static", "dynamic"),
)
"""The engine's option ``rollout.engine_kwargs.decode_cache`` (``rollout.cuda_graph``)."""

SAMPLE_DTYPE = Option(
    "sample_dtype",
    "model",
    "'model': sample with the actor's module as it is (its log-probs are the actor's); "
    "'bfloat16' (opt-in): with a bf16 copy refreshed in place before each call (half the bytes "
    "a decode step reads); refused on a CPU without avx512_bf16 or amx_bf16; its log-probs are "
    "the copy's, so it needs algorithm.rollout_is.enable (old_log_probs recomputed by the "
    "actor, the gap in rollout_corr/* and corrected by the IS weights)",
    choices=("model", "bfloat16"),
)
"""The engine's option ``rollout.engine_kwargs.sample_dtype`` (``rollout.sampler_copy``)."""


def _available() -> str | None:
    return None


@dataclass(frozen=True)
class EngineTraits:
    """What a registered engine declares (its class attributes, or the keywords of
    ``register_rollout_engine``); see ``RolloutEngine``."""

    samples_with_actor_module: bool = False
    exact_log_probs: bool = False
    records_kept_set: bool = False
    unavailable_reason: Callable[[], str | None] = _available
    supports_lora: bool = True
    weights_via: str = "tensors"
    options: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if self.weights_via not in WEIGHT_TRANSFERS:
            raise TypeError(f"weights_via={self.weights_via!r}: choose one of {WEIGHT_TRANSFERS}")


_TRAITS = (
    "samples_with_actor_module",
    "exact_log_probs",
    "records_kept_set",
    "unavailable_reason",
    "supports_lora",
    "weights_via",
    "options",
)


def register_rollout_engine(name: str, *aliases: str, **traits: Any) -> Callable[[E], E]:
    """Decorator: register an engine class (built by its ``from_args(args)``, else
    ``cls(args)``; its class attributes declare the traits) or a builder ``fn(args: EngineArgs)
    -> engine`` under ``name`` and ``aliases``. Keywords (``samples_with_actor_module``,
    ``exact_log_probs``, ``records_kept_set``, ``unavailable_reason``, ``supports_lora``,
    ``weights_via``, ``options``) declare or override the traits."""
    unknown = sorted(set(traits) - set(_TRAITS))
    if unknown:
        raise TypeError(f"register_rollout_engine: unknown traits {unknown}; use {list(_TRAITS)}")

    def wrap(entry: E) -> E:
        defaults = EngineTraits()
        declared = {k: getattr(entry, k, getattr(defaults, k)) for k in _TRAITS}
        declared.update(traits)
        ROLLOUT_ENGINES.register(
            name, *aliases, traits=EngineTraits(**declared), options=tuple(declared["options"])
        )(entry)
        return entry

    return wrap


def engine_entry(name: str) -> Any:
    """The registered engine ``name`` (imported now); ConfigError listing the choices."""
    try:
        return ROLLOUT_ENGINES.get(name)
    except KeyError as e:
        raise ConfigError(f"rollout.engine: {e.args[0]}") from None


def engine_traits(name: str) -> EngineTraits:
    """The traits registered engine ``name`` declares (ConfigError listing the choices if
    none is registered under that name)."""
    if name not in ROLLOUT_ENGINES:
        engine_entry(name)
    return ROLLOUT_ENGINES.info(name)["traits"]


def check_rollout_engine(name: str) -> None:
    """ConfigError (one line) if engine ``name`` is unknown or cannot run on this machine."""
    reason = engine_traits(name).unavailable_reason()
    if reason is not None:
        raise ConfigError(f"rollout.engine={name}: {reason}")


def truncates(cfg: RolloutConfig) -> bool:
    """Training rollouts cut the vocabulary: top-k, top-p or min-p is on."""
    return cfg.top_k > 0 or cfg.top_p < 1.0 or cfg.min_p > 0.0


def check_sampling_replay(cfg: RolloutConfig) -> None:
    """ConfigError (one line) when sampling replay is asked for (``rollout.sampling_replay``
    with top-k/top-p/min-p on) and the engine does not declare ``records_kept_set``."""
    if not (cfg.sampling_replay and truncates(cfg)):
        return
    if not engine_traits(cfg.engine).records_kept_set:
        raise ConfigError(
            f"rollout.engine={cfg.engine} does not record the kept set of top-k/top-p/min-p "
            "sampling that rollout.sampling_replay=true replays: drop the truncation or set "
            "rollout.sampling_replay=false (log-probs over the whole vocabulary, biased)"
        )


def rollout_log_probs_are_actors(cfg: Config) -> bool:
    """The engine's ``rollout_log_probs`` are the actor's own log-probs at the sampling
    temperature: the engine declares ``exact_log_probs``; no top-k/top-p/min-p, or they are
    replayed (``rollout.sampling_replay`` with an engine that ``records_kept_set``); and every
    ``response_mask`` token was sampled (not agent observations with state masking off)."""
    return (
        engine_traits(cfg.rollout.engine).exact_log_probs
        and (not truncates(cfg.rollout) or kept_sets_recorded(cfg))
        and not (strategy_traits(cfg).multi_turn and not cfg.agent.state_masking)
    )


def kept_sets_recorded(cfg: Config) -> bool:
    """Training batches carry ``rollout_kept_counts``: top-k/top-p/min-p is on, with
    ``rollout.sampling_replay`` and an engine that ``records_kept_set`` (single-turn, and
    multi-turn trajectories, which carry each turn's sizes, 0 on observations)."""
    return (
        cfg.rollout.sampling_replay
        and truncates(cfg.rollout)
        and engine_traits(cfg.rollout.engine).records_kept_set
    )


def vllm_unavailable_reason() -> str | None:
    """Why the vLLM engine cannot run here (missing package or no CUDA GPU), or None."""
    if importlib.util.find_spec("vllm") is None:
        return (
            "vllm is not installed: install the extra with `pip install 'creditrl[vllm]'` "
            "(vLLM needs a CUDA GPU)"
        )
    import torch  # only when vllm is asked for: `creditrl config` stays without torch

    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (torch.cuda.is_available() is False); vLLM needs one"
    return None


def _vllm_unavailable() -> str | None:
    reason = vllm_unavailable_reason()
    return None if reason is None else f"{reason}. On CPU use rollout.engine=hf."


def _add_engine(name: str, path: str, traits: EngineTraits) -> None:
    ROLLOUT_ENGINES.add(name, path, traits=traits, options=tuple(traits.options))


_add_engine(
    "hf",
    "creditrl.rollout.hf_engine:HFRolloutEngine",
    EngineTraits(
        samples_with_actor_module=True,
        exact_log_probs=True,
        records_kept_set=True,
        options=(DECODE_CACHE, SAMPLE_DTYPE),
    ),
)
_add_engine(
    "vllm",
    "creditrl.rollout.vllm_engine:VLLMRolloutEngine",
    EngineTraits(
        supports_lora=False,
        unavailable_reason=_vllm_unavailable,
        options=(
            "gpu_memory_utilization",
            "enable_sleep_mode",
            "vllm_dtype",
            "tensor_parallel_size",
        ),
    ),
)
