"""The field catalogue: every standard Batch key, its shape, dtype, meaning and writer.

Shapes: B = batch size, P = prompt length (left-padded), T = response length (right-padded),
P+T = the full sequence. Index convention (docs/architecture.md, spec 000): response column j is
step t = j + 1; ``log_probs[:, j] = log π(y_{j+1} | s_{j+1})`` taken from
``logits[:, -T-1:-1]`` of the full sequence, and ``values[:, j] = V(s_{j+1})``, the value of the
state before token y_{j+1} is chosen. Fields with dtype "object" are non-tensors (one Python
value per sample).

The catalogue is also what the async learner accepts from a sampler
(``creditrl.asynchronous.validation`` derives its tables from it): ``wire`` names the episodes
groups that carry a field, ``kind`` the value check of such a tensor, ``json_types`` the JSON
types of such a non-tensor column's values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from creditrl.batch.batch import Batch

__all__ = ["FIELDS", "FieldSpec", "describe", "require"]


# shape -> width of the second dimension (None: one value per sample)
_WIDTHS = {"(B,)": None, "(B, P)": "P", "(B, T)": "T", "(B, P+T)": "P+T"}
# value checks of the async learner (validation._check_tensors): token ids >= 0, 0/1 masks,
# positions in [0, P+T), finite log-probs <= 0, finite bounded scores, small counts, versions
_KINDS = ("ids", "mask", "position", "version", "log_prob", "score", "count")
# groups of a sampler's episodes: "episode" every group holds (validation.EPISODE_FIELDS and
# its required columns), "optional" some runs add, "agent" agent runs (AGENT_FIELDS),
# "structured" spec 001 structured rewards (STRUCTURED_FIELDS); None: never sent by a sampler
_WIRE = ("episode", "optional", "agent", "structured")


@dataclass(frozen=True)
class FieldSpec:
    """One catalogue entry.

    ``wire``: the episodes groups a sampler sends it in (``_WIRE``; None: the learner refuses
    it from a sampler). For such a tensor, ``kind`` is its value check (``_KINDS``); for such a
    non-tensor column, ``json_types`` the types each value may have (None: any JSON value)."""

    name: str
    shape: str
    dtype: str
    meaning: str
    written_by: str
    wire: str | None = None
    kind: str | None = None
    json_types: tuple[type, ...] | None = None

    def __post_init__(self) -> None:
        bad = []
        if self.shape not in _WIDTHS:
            bad.append(f"shape {self.shape!r}")
        if self.base_dtype not in ("int64", "float32", "object"):
            bad.append(f"dtype {self.dtype!r}")
        if self.wire not in (None, *_WIRE):
            bad.append(f"wire {self.wire!r}")
        if self.kind not in ((None, *_KINDS) if self.is_tensor else (None,)):
            bad.append(f"kind {self.kind!r}")
        if self.is_tensor and self.wire is not None and self.kind is None:
            bad.append("no kind for a tensor a sampler sends")
        if self.json_types is not None and self.is_tensor:
            bad.append("json_types for a tensor")
        if bad:
            raise ValueError(f"field {self.name!r}: bad catalogue entry: {', '.join(bad)}")

    @property
    def base_dtype(self) -> str:
        """``"int64"``, ``"float32"`` (the torch dtype's name) or ``"object"`` (a non-tensor)."""
        return self.dtype.partition("[")[0]

    @property
    def is_tensor(self) -> bool:
        return self.base_dtype != "object"

    @property
    def width(self) -> str | None:
        """The second dimension: ``"P"``, ``"T"``, ``"P+T"``, or None for (B,) fields."""
        return _WIDTHS[self.shape]

    def line(self) -> str:
        """The one-line description used in error messages."""
        return (
            f"{self.name} {self.shape} {self.dtype}: {self.meaning} [written by {self.written_by}]"
        )


_TOK = "log π(y_{j+1} | s_{j+1}) at column j, from logits[:, -T-1:-1]"

# fmt: off
_SPECS = [
    FieldSpec(
        "input_ids", "(B, P+T)", "int64",
        "full sequence token ids, prompt left-padded then response right-padded "
        "(before rollout: the prompt alone, (B, P))",
        "data loader; rollout",
        wire="episode", kind="ids",
    ),
    FieldSpec(
        "attention_mask", "(B, P+T)", "int64",
        "1 on every real token of prompt+response, 0 on padding (before rollout: (B, P))",
        "data loader; rollout",
        wire="episode", kind="mask",
    ),
    FieldSpec(
        "position_ids", "(B, P+T)", "int64",
        "position of each token for the model forward (cumsum of attention_mask - 1)",
        "data loader; rollout",
        wire="episode", kind="position",
    ),
    FieldSpec(
        "prompts", "(B, P)", "int64", "prompt token ids, left-padded", "rollout",
        wire="episode", kind="ids",
    ),
    FieldSpec(
        "responses", "(B, T)", "int64",
        "response token ids y_1..y_T, right-padded; multi-turn: includes appended observation "
        "tokens (response_mask 0)",
        "rollout",
        wire="episode", kind="ids",
    ),
    FieldSpec(
        "response_mask", "(B, T)", "int64",
        "1 on policy-generated tokens incl. EOS; 0 on padding and observation/tool tokens "
        "(spec 001 loss_mask)",
        "rollout; agent loop",
        wire="episode", kind="mask",
    ),
    FieldSpec(
        "turn_ids", "(B, T)", "int64",
        "turn number (1-based) of each response token, 0 on padding (spec 001 "
        "turn_sequence_tensor)",
        "agent loop",
        wire="agent", kind="count",
    ),
    FieldSpec(
        "num_turns", "(B,)", "int64", "number of assistant turns in the trajectory", "agent loop",
        wire="agent", kind="count",
    ),
    FieldSpec(
        "rollout_log_probs", "(B, T)", "float32",
        f"{_TOK}, under the sampling engine's policy", "rollout",
        wire="episode", kind="log_prob",
    ),
    FieldSpec(
        "rollout_kept_counts", "(B, T)", "int64",
        "size n of the set top-k/top-p/min-p let the sampler draw y_{j+1} from at column j "
        "(ties at the cut included; 0 on padding and where nothing was cut): the n largest "
        "logits, over which every log-prob stage renormalises (sampling replay)",
        "rollout (rollout.sampling_replay with truncation on)",
        wire="optional", kind="count",
    ),
    FieldSpec(
        "old_log_probs", "(B, T)", "float32",
        f"{_TOK}, under the actor before this update (π_old); over the kept set when the batch "
        "holds rollout_kept_counts (sampling replay)",
        "actor.compute_log_prob",
    ),
    FieldSpec(
        "ref_log_prob", "(B, T)", "float32",
        f"{_TOK}, under the frozen reference policy; over the n largest of its logits when the "
        "batch holds rollout_kept_counts (sampling replay)",
        "ref.compute_log_prob",
        wire="optional", kind="log_prob",
    ),
    FieldSpec(
        "teacher_log_prob", "(B, T)", "float32",
        "log π_T(y_{j+1} | s^T_{j+1}) at column j: the distillation teacher on its own prompt "
        "followed by the student's response ids y_1..y_j, from logits[:, -T-1:-1]",
        "teacher.compute_log_prob (the learner; the sampler with distill.teacher_on=sampler)",
        wire="optional", kind="log_prob",
    ),
    FieldSpec(
        "teacher_prompt_ids", "(B,)", "object[list[int]]",
        "the distillation teacher's chat-templated prompt ids when distill.teacher_prompt is not "
        "'same' (checked for type, range and length before use)",
        "data loader",
        wire="optional", json_types=(list,),
    ),
    FieldSpec(
        "entropys", "(B, T)", "float32",
        "entropy of π_old(· | s_{j+1}) at column j; of π_old renormalised over the kept set when "
        "the batch holds rollout_kept_counts (sampling replay)",
        "actor.compute_log_prob",
    ),
    FieldSpec(
        "values", "(B, T)", "float32",
        "V(s_{j+1}) at column j: value of the state before y_{j+1} is chosen, from "
        "critic output at logits[:, -T-1:-1]",
        "critic.compute_values",
    ),
    FieldSpec(
        "rm_scores", "(B, T)", "float32",
        "reward-model score placed on the last valid response token, 0 elsewhere",
        "reward model worker",
        wire="optional", kind="score",
    ),
    FieldSpec(
        "token_level_scores", "(B, T)", "float32",
        "task reward for the transition made by a_t; outcome reward on the last valid token",
        "reward manager",
        wire="episode", kind="score",
    ),
    FieldSpec(
        "token_level_rewards", "(B, T)", "float32",
        "(token_level_scores - β·kl_j) * response_mask when KL is in the reward, else the scores",
        "core: kl penalty",
    ),
    FieldSpec(
        "advantages", "(B, T)", "float32",
        "advantage A_t at column j = t - 1 (whitened for GAE), 0 where response_mask is 0",
        "core: advantage estimator",
    ),
    FieldSpec(
        "returns", "(B, T)", "float32",
        "critic targets: raw A + V (GAE) or the estimator's returns",
        "core: advantage estimator",
    ),
    FieldSpec(
        "reward_baselines", "(B,)", "float32",
        "per-sample baseline reward (ReMax: score of the greedy response)",
        "reward manager (ReMax)",
    ),
    FieldSpec(
        "rollout_is_weights", "(B, T)", "float32",
        "truncated importance weights π_old / π_rollout per token, 0 where response_mask is 0",
        "core: rollout importance weights",
    ),
    FieldSpec(
        "loss_mask", "(B, T)", "int64",
        "response_mask without the tokens and sequences rollout correction rejects (mode=mask, "
        "veto); the actor's losses aggregate over it. Absent when nothing can be rejected. "
        "Never replaces response_mask, which defines the trajectory",
        "core: rollout importance weights",
    ),
    FieldSpec(
        "traj_id", "(B,)", "object[str]",
        "'<uid>/<k>': stable id of the trajectory, k its place among its prompt's samples",
        "trainer (after repeat)",
        wire="optional", json_types=(str,),
    ),
    FieldSpec(
        "sample_seed", "(B,)", "int64",
        "per-trajectory sampling seed: the rollout draws this row's uniforms from it, so the "
        "tokens do not depend on how rows are split over micro-batches or workers",
        "trainer (after repeat)",
    ),
    FieldSpec(
        "max_new_tokens", "(B,)", "int64",
        "per-row cap on the tokens a rollout call may sample (an agent turn's own budget, or a "
        "chunk of it); rows end there as at EOS. Engine input only, never trained on",
        "agent turn generator",
    ),
    FieldSpec(
        "uid", "(B,)", "object[str]",
        "prompt group id; samples of the same prompt share it (GRPO/RLOO grouping)",
        "trainer (before repeat)",
        wire="episode", json_types=(str,),
    ),
    FieldSpec(
        "data_source", "(B,)", "object[str]",
        "dataset/task name; selects the reward function", "data loader",
        wire="optional", json_types=(str,),
    ),
    FieldSpec(
        "ground_truth", "(B,)", "object", "reference answer for rule-based rewards", "data loader",
        wire="optional",
    ),
    FieldSpec(
        "index", "(B,)", "object[int]", "row number of the prompt in its dataset split",
        "data loader", wire="optional", json_types=(int,),
    ),
    FieldSpec(
        "extra_info", "(B,)", "object[dict]",
        "dataset-provided per-sample info (index, split, tool kwargs)", "data loader",
        wire="optional", json_types=(dict,),
    ),
    FieldSpec(
        "reward_extra_info", "(B,)", "object[dict]",
        "reward manager's per-sample extras (sub-scores, parse results), logged as metrics",
        "reward manager",
        wire="optional", json_types=(dict,),
    ),
    FieldSpec(
        "structured_rewards", "(B,)", "object[dict]",
        'spec 001 per-sample {"turn_rewards": {"turn": r}, "global_rewards": {name: r}} '
        "(turn numbers as string keys, so the Batch serialises as JSON)",
        "reward manager (structured multi-turn)",
        wire="optional", json_types=(dict,),
    ),
    FieldSpec(
        "raw_prompt", "(B,)", "object[list[dict]]",
        "prompt chat messages as text (logs, rewards, humans; never re-encoded for training)",
        "data loader",
        wire="optional", json_types=(list, str),
    ),
    FieldSpec(
        "messages", "(B,)", "object[list[dict]]",
        "full conversation as text after the rollout (logs, rewards, humans)",
        "rollout; agent loop",
        wire="optional", json_types=(list,),
    ),
    FieldSpec(
        "tool_calls", "(B,)", "object[list[dict]]",
        "the trajectory's tool calls: turn, name, arguments, status (ok, error, timeout, "
        "unknown_tool, bad_arguments, malformed, skipped), output as observed, seconds",
        "agent loop",
        wire="optional", json_types=(list,),
    ),
    FieldSpec(
        "agent_info", "(B,)", "object[dict]",
        "stop_reason (answer, no_call, max_turns, length), num_turns, observation_tokens, "
        "observation_truncated, turns (text and answer of each assistant turn)",
        "agent loop",
        wire="optional", json_types=(dict,),
    ),
    FieldSpec(
        "tokenization_drift", "(B,)", "object[dict]",
        "spec 004 drift reports of checked rows (first divergence of re-tokenization and of the "
        "chat template, both spans decoded); None for unchecked rows",
        "agent drift checks (trainer)",
        wire="optional", json_types=(dict, type(None)),
    ),
    FieldSpec(
        "turn_scores", "(B,)", "float32",
        "spec 001 mean turn reward of each sample (the turn part of total_score)",
        "reward manager (structured multi-turn)",
        wire="structured", kind="score",
    ),
    FieldSpec(
        "global_scores", "(B,)", "float32",
        "spec 001 sum of counted global rewards of each sample (keys without a leading '_')",
        "reward manager (structured multi-turn)",
        wire="structured", kind="score",
    ),
    FieldSpec(
        "trajectory_score", "(B,)", "float32",
        "spec 001 step 6 score saved with a trajectory: returns summed over response_mask",
        "agent hooks (after advantages)",
    ),
    FieldSpec(
        "weight_version", "(B,)", "int64",
        "policy version (learner optimizer steps published) that sampled the episode (its "
        "first token, with partial rollout: the oldest of token_weight_version)",
        "async sampler",
        wire="episode", kind="version",
    ),
    FieldSpec(
        "token_weight_version", "(B, T)", "int64",
        "policy version that sampled y_{j+1} at column j: it rises where a sampler took newer "
        "weights mid-response (partial rollout); weight_version is the row's lowest; 0 on padding",
        "async sampler (asynchronous.partial_rollout)",
        wire="optional", kind="version",
    ),
    FieldSpec(
        "staleness", "(B,)", "int64",
        "learner version at training time minus weight_version (0: on-policy)",
        "async learner",
    ),
    FieldSpec(
        "episode_id", "(B,)", "object[str]",
        "'<sampler_id>:<seq>:<k>': unique per episode, the unit of acknowledgement",
        "async sampler",
        wire="episode", json_types=(str,),
    ),
    FieldSpec(
        "sampler_id", "(B,)", "object[str]", "the sampler that produced the episode",
        "async sampler",
        wire="episode", json_types=(str,),
    ),
]
# fmt: on

FIELDS: dict[str, FieldSpec] = {s.name: s for s in _SPECS}


def describe(name: str) -> str:
    """One catalogue line for ``name``; KeyError if it is not catalogued."""
    if name not in FIELDS:
        raise KeyError(f"{name!r} is not in the field catalogue (creditrl.batch.FIELDS)")
    return FIELDS[name].line()


def _check_shape(batch: Batch, name: str) -> None:
    spec = FIELDS.get(name)
    tensor = batch.tensors.get(name, None)
    if spec is None or tensor is None:
        return
    shape = tuple(tensor.shape)
    responses = batch.tensors.get("responses", None)
    prompts = batch.tensors.get("prompts", None)
    if spec.shape == "(B,)":
        expected: tuple[int, ...] = (len(batch),)
        ok = len(shape) == 1
    elif spec.shape == "(B, T)" and responses is not None:
        expected = tuple(responses.shape)
        ok = shape == expected
    elif spec.shape == "(B, P+T)" and responses is not None and prompts is not None:
        expected = (len(batch), prompts.shape[-1] + responses.shape[-1])
        ok = len(shape) >= 2 and shape[-1] == expected[-1]
    else:
        return
    if not ok:
        raise ValueError(
            f"field {name!r} has shape {shape}, expected {spec.shape} = {expected}; "
            f"catalogue: {spec.line()}"
        )


def require(batch: Batch, *names: str) -> None:
    """Check that ``batch`` holds ``names`` with catalogue-consistent shapes.

    Raises KeyError naming a missing field (with its catalogue line), and ValueError when a
    catalogued tensor's shape contradicts the catalogue: (B, T) fields must match ``responses``,
    (B, P+T) fields must end in prompts' P + responses' T, (B,) fields must be 1-D.
    """
    for name in names:
        if name not in batch:
            line = FIELDS[name].line() if name in FIELDS else "not in the field catalogue"
            raise KeyError(f"batch is missing required field {name!r}; catalogue: {line}")
        _check_shape(batch, name)
