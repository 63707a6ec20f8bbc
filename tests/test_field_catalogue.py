"""The field catalogue (creditrl.batch.FIELDS) is the one table of dtypes, widths and value
checks: the async learner's message validator derives what it accepts from it."""

import dataclasses

import pytest
import torch

from creditrl.asynchronous import validation
from creditrl.asynchronous.messages import episode_ids, group_of
from creditrl.asynchronous.validation import (
    AGENT_FIELDS,
    DEFAULT_JSON_LIMITS,
    EPISODE_FIELDS,
    STRUCTURED_FIELDS,
    MessageError,
    check_payload,
    max_group_bytes,
)
from creditrl.batch import FIELDS, Batch, FieldSpec, describe, fields

# What the validator checked when it kept its own tables: tensor -> (dtype, width, kind), and
# non-tensor column -> JSON types (None: any). The catalogue must still say exactly this.
VALIDATOR_TENSORS = {
    "input_ids": ("int64", "P+T", "ids"),
    "attention_mask": ("int64", "P+T", "mask"),
    "position_ids": ("int64", "P+T", "position"),
    "prompts": ("int64", "P", "ids"),
    "responses": ("int64", "T", "ids"),
    "response_mask": ("int64", "T", "mask"),
    "rollout_log_probs": ("float32", "T", "log_prob"),
    "rollout_kept_counts": ("int64", "T", "count"),
    "ref_log_prob": ("float32", "T", "log_prob"),
    "teacher_log_prob": ("float32", "T", "log_prob"),
    "token_level_scores": ("float32", "T", "score"),
    "rm_scores": ("float32", "T", "score"),
    "weight_version": ("int64", None, "version"),
    "token_weight_version": ("int64", "T", "version"),
    "turn_ids": ("int64", "T", "count"),
    "num_turns": ("int64", None, "count"),
    "turn_scores": ("float32", None, "score"),
    "global_scores": ("float32", None, "score"),
}
VALIDATOR_COLUMNS = {
    "uid": (str,), "episode_id": (str,), "sampler_id": (str,), "raw_prompt": (list, str),
    "ground_truth": None, "data_source": (str,), "extra_info": (dict,), "index": (int,),
    "reward_extra_info": (dict,), "traj_id": (str,), "tool_calls": (list,),
    "agent_info": (dict,), "messages": (list,), "structured_rewards": (dict,),
    "tokenization_drift": (dict, type(None)), "teacher_prompt_ids": (list,),
}  # fmt: skip


def test_every_tensor_the_validator_checks_is_catalogued_with_its_dtype_and_width() -> None:
    assert set(validation._tensors()) == set(VALIDATOR_TENSORS)
    for name, (dtype, width, kind) in VALIDATOR_TENSORS.items():
        spec = FIELDS[name]
        assert (spec.dtype, spec.width, spec.kind) == (dtype, width, kind), name
        assert validation._dtype(spec) == getattr(torch, dtype)
    assert validation._columns() == VALIDATOR_COLUMNS
    for name in VALIDATOR_COLUMNS:
        assert not FIELDS[name].is_tensor and FIELDS[name].base_dtype == "object"


def test_the_groups_are_the_catalogues() -> None:
    assert EPISODE_FIELDS == (
        "input_ids", "attention_mask", "position_ids", "prompts", "responses", "response_mask",
        "rollout_log_probs", "token_level_scores", "weight_version",
    )  # fmt: skip
    assert AGENT_FIELDS == ("turn_ids", "num_turns")
    assert STRUCTURED_FIELDS == ("turn_scores", "global_scores")
    assert validation._REQUIRED_COLUMNS == ("uid", "episode_id", "sampler_id")
    for name in (*EPISODE_FIELDS, *AGENT_FIELDS, *STRUCTURED_FIELDS):
        assert FIELDS[name].wire in ("episode", "agent", "structured")
    # learner-side fields are never accepted from a sampler
    for name in ("old_log_probs", "advantages", "returns", "values", "staleness", "loss_mask"):
        assert FIELDS[name].wire is None and name not in validation._tensors()
    # computed by either side: the learner accepts them only when its config says so
    for name in ("ref_log_prob", "teacher_log_prob", "rollout_kept_counts", "token_weight_version"):
        assert FIELDS[name].wire == "optional"


def test_max_group_bytes_is_unchanged() -> None:
    # the number the validator's own table gave (8 answers, P=512, T=1024), plus a float32
    # (B, T) teacher_log_prob (distill.teacher_on=sampler), an int64 (B, T)
    # rollout_kept_counts (sampling replay) and an int64 (B, T) token_weight_version (partial
    # rollout): 20 bytes per response token
    assert max_group_bytes(8, 512, 1024, DEFAULT_JSON_LIMITS) == 67780800 + 8 * 1024 * 20
    assert max_group_bytes(1, 1, 1, DEFAULT_JSON_LIMITS) == 67125368 + 20
    assert max_group_bytes(2, 3, 4, DEFAULT_JSON_LIMITS) == 67126000 + 2 * 4 * 20


def test_catalogue_entries_are_consistent() -> None:
    for name, spec in FIELDS.items():
        assert spec.name == name
        assert spec.base_dtype in ("int64", "float32", "object")
        assert (
            spec.width
            == {"(B,)": None, "(B, P)": "P", "(B, T)": "T", "(B, P+T)": "P+T"}[spec.shape]
        )
        if spec.json_types is not None:  # the dtype's outer type is among the allowed ones
            outer = spec.dtype.removeprefix("object[").partition("[")[0].rstrip("]")
            assert outer in {t.__name__ for t in spec.json_types}, name
    # the five positional attributes still build an entry, off the wire
    spec = FieldSpec("x", "(B, T)", "float32", "m", "w")
    assert (spec.wire, spec.kind, spec.json_types, spec.is_tensor) == (None, None, None, True)
    assert describe("index").startswith("index (B,) object[int]: ")
    with pytest.raises(ValueError, match="kind"):  # a non-tensor has no value kind
        dataclasses.replace(FIELDS["uid"], kind="ids")


GOOD = {"name": "x", "shape": "(B, T)", "dtype": "float32", "meaning": "m", "written_by": "w"}


@pytest.mark.parametrize(
    "changes, what",
    [
        ({"shape": "(T,)"}, "shape"),
        ({"dtype": "float64"}, "dtype"),
        ({"wire": "sometimes"}, "wire"),
        ({"wire": "optional"}, "no kind"),
        ({"kind": "probability"}, "kind"),
        ({"json_types": (str,)}, "json_types"),
    ],
)
def test_a_bad_catalogue_entry_is_refused(changes, what) -> None:
    with pytest.raises(ValueError, match=what):
        FieldSpec(**{**GOOD, **changes})


# ---- a field added to the catalogue is what the validator accepts ------------------------


def _group(**extra_tensors: torch.Tensor) -> Batch:
    p, t = 3, 4
    prompts = torch.full((2, p), 5)
    responses = torch.full((2, t), 7)
    mask = torch.ones(2, t, dtype=torch.long)
    attention = torch.ones(2, p + t, dtype=torch.long)
    batch = Batch(
        {
            "prompts": prompts,
            "responses": responses,
            "response_mask": mask,
            "input_ids": torch.cat([prompts, responses], 1),
            "attention_mask": attention,
            "position_ids": attention.cumsum(1) - 1,
            "token_level_scores": torch.zeros(2, t),
            "rollout_log_probs": torch.full((2, t), -0.5),
            **extra_tensors,
        },
        {"uid": ["s0:0"] * 2},
    )
    return group_of(batch, "s0", 0, 0)


def _check(group: Batch) -> Batch:
    return check_payload(group.to_bytes(), "s0", 0, 0, episode_ids("s0", 0, 2))[0]


@pytest.fixture
def probe(monkeypatch):
    """A copy of the catalogue with a new optional tensor, ``probe_scores`` (B, T) float32."""
    spec = FieldSpec("probe_scores", "(B, T)", "float32", "a test field", "test",
                     wire="optional", kind="score")  # fmt: skip
    monkeypatch.setattr(fields, "FIELDS", {**FIELDS, "probe_scores": spec})
    return spec


def test_an_uncatalogued_tensor_is_refused() -> None:
    _check(_group())
    with pytest.raises(MessageError, match=r"does not know.*probe_scores") as e:
        _check(_group(probe_scores=torch.zeros(2, 4)))
    assert e.value.reason == "fields"


def test_a_catalogued_tensor_is_accepted_with_its_dtype_and_refused_without(probe) -> None:
    ok = _check(_group(probe_scores=torch.zeros(2, 4)))
    assert ok["probe_scores"].dtype == torch.float32
    with pytest.raises(
        MessageError, match=r"probe_scores is torch\.float64, not torch\.float32"
    ) as e:
        _check(_group(probe_scores=torch.zeros(2, 4, dtype=torch.float64)))
    assert e.value.reason == "dtype"
    with pytest.raises(MessageError, match="probe_scores has shape") as e:
        _check(_group(probe_scores=torch.zeros(2, 5)))
    assert e.value.reason == "shape"
    with pytest.raises(MessageError, match="probe_scores holds non-finite") as e:
        _check(_group(probe_scores=torch.full((2, 4), float("nan"))))
    assert e.value.reason == "non_finite"
    # and it counts toward the most a group can hold: 2 rows of T=4 float32 more
    assert max_group_bytes(2, 3, 4, DEFAULT_JSON_LIMITS) == 67126000 + 2 * 4 * 20 + 2 * 4 * 4


def test_an_int_catalogue_entry_refuses_floats(monkeypatch) -> None:
    spec = FieldSpec("probe_count", "(B,)", "int64", "a test count", "test",
                     wire="optional", kind="count")  # fmt: skip
    monkeypatch.setattr(fields, "FIELDS", {**FIELDS, "probe_count": spec})
    _check(_group(probe_count=torch.tensor([1, 2])))
    with pytest.raises(MessageError, match=r"probe_count is torch\.float32, not torch\.int64") as e:
        _check(_group(probe_count=torch.tensor([1.0, 2.0])))
    assert e.value.reason == "dtype"
    with pytest.raises(MessageError, match="counts outside") as e:
        _check(_group(probe_count=torch.tensor([-1, 2])))
    assert e.value.reason == "value"
