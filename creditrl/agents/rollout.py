"""AgentRollout: the agent loop behind the rollout engine's interface, so the trainer's rollout
stage runs multi-turn tool use with any engine.

``generate(prompts, greedy=False, temperature=None, seed=None) -> Batch`` takes the prompt Batch
(left-padded ``input_ids``/``attention_mask``; ``raw_prompt`` messages if present) and returns
what ``HFRolloutEngine.generate`` returns (``prompts``, ``responses``, ``response_mask``,
``input_ids``, ``attention_mask``, ``position_ids``, ``rollout_log_probs``) plus ``turn_ids``
(B, T) and ``num_turns`` (B,), and the non-tensors ``messages`` (the conversation as text),
``tool_calls`` (records), ``agent_info`` (stop reason, turns) and ``tokenization_drift`` (drift
reports of the checked rows, else None). T is the longest response.

Masks (spec 001): ``attention_mask`` is 1 on every real token, observations included.
``response_mask`` is 1 on the policy's tokens only (``state_masking``, the default); with
``agent.state_masking=false`` it is the response part of ``attention_mask``, as spec 001's
mask table prescribes for that setting. ``rollout_log_probs`` is 0 on observation tokens.

An episode that recorded no model turn (an agent program that failed first, a first prompt the
engine returned nothing for) is one placeholder response token (the pad id, mask 1, turn 0,
``num_turns`` 0): it carries the episode's score (``reward.fallback_score``) through scoring
and advantages, and the pipeline masks it out before any update
(``creditrl.pipeline.stages.score_only_rows``), so it is counted and never trained on.

``last_metrics`` holds the latest batch's ``agent_metrics`` (``tools/*``, ``num_turns/*``,
``agent/*``); ``last_stats["prefill_tokens"]`` the tokens prefilled over all its turns, when
the turn generator counts them (``EngineTurnGenerator.last_run_stats``). The drift checks run
on the batch afterwards (``creditrl.agents.hooks``), where the trainer has it.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import torch

from creditrl.agents.drift import DRIFT_FIELD
from creditrl.agents.loop import STOP_REASONS, AgentLoop, Trajectory
from creditrl.batch import Batch, assemble_rollout_batch
from creditrl.config.schema import AgentConfig, Config, RolloutConfig
from creditrl.rollout.continuation import EngineTurnGenerator, TurnGenerator
from creditrl.tools import TOOL_STATUSES, ToolRegistry, build_registry

if TYPE_CHECKING:
    from creditrl.rollout.engine import RolloutEngine

__all__ = [
    "AGENT_FIELDS",
    "OK_EPISODES",
    "AgentRollout",
    "EngineRollout",
    "agent_loop_rollout",
    "agent_metrics",
    "failed_episodes",
    "trajectories_to_batch",
]

AGENT_FIELDS = ("messages", "tool_calls", "agent_info", DRIFT_FIELD)
_DUMPED = ("num_turns", "agent_info", "tool_calls", DRIFT_FIELD)


def trajectories_to_batch(
    prompts: Batch,
    trajectories: list[Trajectory],
    pad_token_id: int,
    state_masking: bool = True,
) -> Batch:
    """The rollout Batch of ``trajectories`` (one per row of ``prompts``); see the module
    docstring for the fields."""
    size = len(trajectories)
    width = max(1, max(len(t.response_ids) for t in trajectories))
    responses = torch.full((size, width), pad_token_id, dtype=torch.long)
    policy_mask = torch.zeros((size, width), dtype=torch.long)
    real = torch.zeros((size, width), dtype=torch.long)
    turn_ids = torch.zeros((size, width), dtype=torch.long)
    log_probs = torch.zeros((size, width), dtype=torch.float32)
    kept = torch.zeros((size, width), dtype=torch.long)
    versioned = any(t.versions is not None for t in trajectories)
    versions = torch.zeros((size, width), dtype=torch.long)
    for i, traj in enumerate(trajectories):
        n = len(traj.response_ids)
        responses[i, :n] = torch.tensor(traj.response_ids, dtype=torch.long)
        policy_mask[i, :n] = torch.tensor(traj.response_mask, dtype=torch.long)
        real[i, :n] = 1
        turn_ids[i, :n] = torch.tensor(traj.turn_ids, dtype=torch.long)
        log_probs[i, :n] = torch.tensor(traj.log_probs, dtype=torch.float32)
        if traj.kept_counts:
            kept[i, :n] = torch.tensor(traj.kept_counts, dtype=torch.long)
        if versioned:  # -1: not known here (filled in with the group's version)
            known = traj.versions if traj.versions is not None else [-1] * max(n, 1)
            versions[i, : len(known)] = torch.tensor(known, dtype=torch.long)
    response_mask = policy_mask if state_masking else real.clone()
    empty = [i for i, t in enumerate(trajectories) if not t.response_ids]
    real[empty, 0] = 1  # the placeholder that carries an empty episode's score
    response_mask[empty, 0] = 1
    extra = {
        "turn_ids": turn_ids,
        "num_turns": torch.tensor(
            [t.num_turns if t.response_ids else 0 for t in trajectories], dtype=torch.long
        ),
    }
    if bool(kept.any()):  # the sampler's kept sets (sampling replay), 0: whole vocabulary
        extra["rollout_kept_counts"] = kept * policy_mask
    if versioned:  # partial rollout: the weight version of each token
        extra["token_weight_version"] = versions
    out = assemble_rollout_batch(
        prompts, responses, log_probs, real, response_mask=response_mask, extra=extra
    )
    non_tensors = out.non_tensors
    non_tensors["messages"] = [t.messages for t in trajectories]
    non_tensors["tool_calls"] = [[c.as_dict() for c in t.tool_calls] for t in trajectories]
    non_tensors["agent_info"] = [
        {
            "stop_reason": t.stop_reason,
            "num_turns": t.num_turns,
            "observation_truncated": t.observation_truncated,
            "observation_tokens": t.response_mask.count(0),
            "turns": t.turns,
        }
        for t in trajectories
    ]
    non_tensors[DRIFT_FIELD] = [None] * size
    meta = dict(prompts.meta)
    keys = list(meta.get("reward_extra_keys", []))
    meta["reward_extra_keys"] = keys + [k for k in _DUMPED if k not in keys]
    return Batch(dict(out.tensors.items()), non_tensors, meta)


def agent_metrics(batch: Batch) -> dict[str, float]:
    """Tool and turn metrics of a rollout batch (from its ``tool_calls``, ``agent_info``,
    ``num_turns`` and masks, so they can be computed wherever the batch is):
    ``tools/calls``, ``tools/errors`` (failed calls other than timeouts), ``tools/timeouts``,
    ``tools/success_rate`` (calls that parsed and ran without error / calls; 0 without calls),
    ``tools/calls_per_sample``, ``tools/status/<status>`` counts, ``num_turns/{mean,max,min}``,
    ``agent/stop_<reason>`` (fractions of samples) and ``agent/observation_tokens_mean``."""
    size = max(len(batch), 1)
    records = [c for calls in batch["tool_calls"] for c in (calls or [])]
    statuses = Counter(str(c["status"]) for c in records)
    calls = sum(statuses.values())
    turns = batch["num_turns"].to(torch.float64)
    infos = [info or {} for info in batch["agent_info"]]
    observation = sum(int(info.get("observation_tokens", 0)) for info in infos)
    stops = Counter(str(info.get("stop_reason")) for info in infos)
    metrics = {
        "tools/calls": float(calls),
        "tools/errors": float(calls - statuses["ok"] - statuses["timeout"]),
        "tools/timeouts": float(statuses["timeout"]),
        "tools/success_rate": statuses["ok"] / calls if calls else 0.0,
        "tools/calls_per_sample": calls / size,
        "num_turns/mean": float(turns.mean()),
        "num_turns/max": float(turns.max()),
        "num_turns/min": float(turns.min()),
        "agent/observation_tokens_mean": observation / size,
    }
    for status in TOOL_STATUSES[1:]:
        metrics[f"tools/status/{status}"] = float(statuses[status])
    for reason in (*STOP_REASONS, *sorted(set(stops) - set(STOP_REASONS) - {"None"})):
        metrics[f"agent/stop_{reason}"] = stops[reason] / size
    metrics.update(_program_metrics(batch, infos))
    return metrics


OK_EPISODES = ("ok", "truncated")  # statuses scored and trained on as they are


def failed_episodes(batch: Batch) -> tuple[int, int, str]:
    """(episodes that failed or were refused, episodes, the first failure's status and
    reason) of an ``agent.program`` or environment batch; (0, 0, "") for other batches."""
    infos = [info or {} for info in batch["agent_info"]] if "agent_info" in batch else []
    statuses = [info.get("episode") for info in infos if "episode" in info]
    failed = [info for info in infos if info.get("episode") not in (None, *OK_EPISODES)]
    if not failed:
        return 0, len(statuses), ""
    first = failed[0]
    why = str(first.get("episode_error") or "")[:300]
    return len(failed), len(statuses), f"{first['episode']}: {why}".rstrip(": ")


def _program_metrics(batch: Batch, infos: list[dict[str, Any]]) -> dict[str, float]:
    """For ``agent.program`` batches: ``agent/episodes_<status>`` counts, the share of
    trajectories whose requests drifted from the recorded ids
    (``tokenization/endpoint_drift_rate``), those whose history was rewritten
    (``tokenization/endpoint_rewritten``), and the endpoint's ``endpoint/*`` counters."""
    if not any("episode" in info for info in infos):
        return {}
    size = max(len(infos), 1)
    episodes = Counter(str(info.get("episode")) for info in infos)
    metrics = {f"agent/episodes_{status}": float(count) for status, count in episodes.items()}
    drifted = sum(bool(info.get("endpoint_drift")) for info in infos)
    metrics["tokenization/endpoint_drift_rate"] = drifted / size
    metrics["tokenization/endpoint_rewritten"] = float(
        sum(info.get("stop_reason") == "rewritten" for info in infos)
    )
    for key, value in (batch.meta.get("endpoint") or {}).items():
        metrics[f"endpoint/{key}"] = float(value)
    return metrics


class EngineRollout:
    """What every multi-turn rollout over ``engine`` shares: the pad id, the latest batch's
    metrics, trajectories and stats, and the engine's generator and model (weight syncs and
    checkpoints see the engine's)."""

    def __init__(self, engine: RolloutEngine | None, tokenizer: Any) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else tokenizer.eos_token_id)
        self.last_metrics: dict[str, float] = {}
        self.last_trajectories: list[Trajectory] = []
        self.last_stats: dict[str, float] = {}

    @property
    def generator(self) -> torch.Generator | None:
        """The engine's generator (None without an engine: a scripted turn generator)."""
        return None if self.engine is None else self.engine.generator

    @property
    def model(self) -> Any:
        """The engine's model."""
        return self.engine.model

    def turn_stats(self) -> dict[str, float]:
        """``prefill_tokens``: the tokens prefilled over the latest run's turns, when its turn
        generator (``self.turns``) counts them (``EngineTurnGenerator.last_run_stats``)."""
        prefill = getattr(self.turns, "last_run_stats", {}).get("prefill_tokens")
        return {} if prefill is None else {"prefill_tokens": float(prefill)}


class AgentRollout(EngineRollout):
    """Multi-turn rollouts through ``engine``; see the module docstring.

    ``turn_generator`` replaces the engine adapter (tests pass a scripted one); ``tools``
    replaces the registry built from ``agent_cfg``. ``generator`` is the engine's
    ``torch.Generator`` (saved in checkpoints like the plain engine's).
    """

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        agent_cfg: AgentConfig,
        rollout_cfg: RolloutConfig,
        *,
        tools: ToolRegistry | None = None,
        turn_generator: TurnGenerator | None = None,
    ) -> None:
        super().__init__(engine, tokenizer)
        self.cfg = agent_cfg
        self.turns = turn_generator or EngineTurnGenerator(
            engine,
            tokenizer,
            max_tokens_per_turn=agent_cfg.max_tokens_per_turn,
            stop=agent_cfg.stop,
            keep_kv_cache=agent_cfg.keep_kv_cache,
        )
        self.tools = tools or build_registry(
            agent_cfg.tools,
            agent_cfg.tool_config,
            agent_cfg.tool_timeout_s,
            agent_cfg.max_parallel_calls,
        )
        self.loop = AgentLoop(
            self.turns, tokenizer, self.tools, agent_cfg, rollout_cfg.max_response_length
        )

    def generate(
        self,
        prompts: Batch,
        *,
        greedy: bool = False,
        temperature: float | None = None,
        seed: int | None = None,
    ) -> Batch:
        """Multi-turn trajectories for every row of ``prompts``; ``seed`` re-seeds the
        engine's generator first (rows with a ``sample_seed`` use their own streams)."""
        if seed is not None and self.generator is not None:
            self.generator.manual_seed(seed)
        ids, mask = prompts["input_ids"].cpu(), prompts["attention_mask"].cpu()
        prompt_ids = [row[m.bool()].tolist() for row, m in zip(ids, mask, strict=True)]
        raw = list(prompts["raw_prompt"]) if "raw_prompt" in prompts else None
        raw = [r if isinstance(r, list) else None for r in raw] if raw is not None else None
        seeds = prompts["sample_seed"].tolist() if "sample_seed" in prompts else None
        trajectories = self.loop.run(
            prompt_ids, raw, greedy=greedy, temperature=temperature, seeds=seeds
        )
        batch = trajectories_to_batch(
            prompts, trajectories, self.pad_token_id, self.cfg.state_masking
        )
        self.last_metrics = agent_metrics(batch)
        self.last_trajectories = trajectories
        self.last_stats = self.turn_stats()
        return batch


def agent_loop_rollout(engine: Any, tokenizer: Any, cfg: Config) -> AgentRollout:
    """The ``agent_loop`` rollout strategy: the built-in loop around ``engine``."""
    return AgentRollout(engine, tokenizer, cfg.agent, cfg.rollout)
