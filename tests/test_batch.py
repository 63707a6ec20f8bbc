"""Unit tests for creditrl.batch: construction, indexing, combining, sharding, serialization."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from creditrl.batch import FIELDS, Batch, FieldSpec, describe, pad_to_divisor, require, unpad


def make_batch(b: int = 4, p: int = 3, t: int = 5) -> Batch:
    gen = torch.Generator().manual_seed(0)
    responses = torch.randint(0, 100, (b, t), generator=gen)
    prompts = torch.randint(0, 100, (b, p), generator=gen)
    return Batch.from_dict(
        {
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "response_mask": torch.ones(b, t, dtype=torch.bool),
            "old_log_probs": torch.randn(b, t, generator=gen),
        },
        {
            "uid": [f"u{i}" for i in range(b)],
            "extra_info": [{"index": i, "tags": ["x", i]} for i in range(b)],
        },
        {"step": 7, "temperature": 1.0},
    )


def uids(batch: Batch) -> list[str]:
    return batch["uid"].tolist()


# ---- construction and validation -------------------------------------------------------------


def test_from_dict_stores_tensordict_object_arrays_and_meta() -> None:
    b = make_batch()
    assert len(b) == 4
    assert list(b.tensors.batch_size) == [4]
    assert b["uid"].dtype == object and b["uid"].shape == (4,)
    assert b["extra_info"][2] == {"index": 2, "tags": ["x", 2]}
    assert b.meta == {"step": 7, "temperature": 1.0}
    assert b.keys() == [
        "prompts", "responses", "input_ids", "response_mask", "old_log_probs", "uid", "extra_info"
    ]  # fmt: skip
    assert "uid" in b and "responses" in b and "values" not in b


def test_lists_of_lists_become_one_object_per_sample() -> None:
    b = Batch.from_dict(
        {"x": torch.zeros(2)}, {"msgs": [[1, 2], [3, 4]], "s": np.array(["a", "b"])}
    )
    assert b["msgs"].shape == (2,) and b["msgs"][1] == [3, 4]
    assert b["s"].dtype == object and b["s"].tolist() == ["a", "b"]


def test_wrong_length_uncatalogued_field_names_it() -> None:
    with pytest.raises(ValueError, match=r"field 'my_thing' has first dim 3.*batch size is 4") as e:
        Batch.from_dict({"responses": torch.zeros(4, 2), "my_thing": torch.zeros(3)})
    assert "catalogue" not in str(e.value)


def test_wrong_length_catalogued_field_quotes_catalogue_line() -> None:
    with pytest.raises(ValueError, match="'advantages'") as e:
        Batch.from_dict({"responses": torch.zeros(4, 2), "advantages": torch.zeros(5, 2)})
    assert describe("advantages") in str(e.value)
    with pytest.raises(ValueError, match="'uid'") as e:
        Batch.from_dict({"responses": torch.zeros(4, 2)}, {"uid": ["a", "b"]})
    assert describe("uid") in str(e.value)


def test_setitem_checks_length_and_replaces_fields() -> None:
    b = make_batch()
    b["values"] = torch.zeros(4, 5)
    assert b["values"].shape == (4, 5)
    with pytest.raises(ValueError, match=r"'values'.*first dim 3") as e:
        b["values"] = torch.zeros(3, 5)
    assert describe("values") in str(e.value)
    with pytest.raises(ValueError, match="'note'"):
        b["note"] = ["a"]
    b["values"] = ["v"] * 4  # a tensor field replaced by a non-tensor one
    assert b["values"].tolist() == ["v"] * 4 and "values" not in b.tensors
    del b["values"]
    assert "values" not in b
    with pytest.raises(KeyError, match="'nope'"):
        b["nope"]


def test_field_in_both_tensors_and_non_tensors_rejected() -> None:
    with pytest.raises(ValueError, match="'x'"):
        Batch.from_dict({"x": torch.zeros(2)}, {"x": ["a", "b"]})


def test_non_tensor_only_and_empty_batches() -> None:
    assert len(Batch.from_dict({}, {"uid": ["a", "b", "c"]})) == 3
    assert len(Batch.from_dict({})) == 0
    assert len(Batch(batch_size=5)) == 5


# ---- select / pop / rename / union / concat ---------------------------------------------------


def test_select_shares_storage_and_copies_meta() -> None:
    b = make_batch()
    s = b.select("responses", "uid")
    assert s.keys() == ["responses", "uid"]
    assert s["responses"].data_ptr() == b["responses"].data_ptr()
    assert s["uid"] is b["uid"]
    s.meta["step"] = 99
    assert b.meta["step"] == 7
    with pytest.raises(KeyError, match=r"'ref_log_prob'.*catalogue"):
        b.select("ref_log_prob")


def test_pop_removes_and_returns() -> None:
    b = make_batch()
    logp = b["old_log_probs"]
    popped = b.pop("old_log_probs", "extra_info")
    assert popped.keys() == ["old_log_probs", "extra_info"]
    assert popped["old_log_probs"] is logp
    assert "old_log_probs" not in b and "extra_info" not in b and len(b) == 4


def test_rename_in_place() -> None:
    b = make_batch()
    mask = b["response_mask"]
    assert b.rename("response_mask", "loss_mask") is b
    assert b["loss_mask"] is mask and "response_mask" not in b
    b.rename("uid", "group")
    assert b["group"].tolist() == ["u0", "u1", "u2", "u3"]
    with pytest.raises(ValueError, match="'responses' already exists"):
        b.rename("prompts", "responses")
    with pytest.raises(KeyError, match="'absent'"):
        b.rename("absent", "x")


def test_union_merges_equal_overlap() -> None:
    b = make_batch()
    other = Batch.from_dict(
        {"responses": b["responses"].clone(), "values": torch.ones(4, 5)},
        {"uid": list(uids(b)), "data_source": ["gsm8k"] * 4},
        {"step": 7, "flag": True},
    )
    merged = b.union(other)
    assert set(merged.keys()) == set(b.keys()) | {"values", "data_source"}
    assert torch.equal(merged["values"], torch.ones(4, 5))
    assert merged["data_source"].tolist() == ["gsm8k"] * 4
    assert merged.meta == {"step": 7, "temperature": 1.0, "flag": True}
    assert "values" not in b  # union returns a new batch


@pytest.mark.parametrize(
    ("tensors", "non_tensors", "meta", "key"),
    [
        ({"responses": torch.zeros(4, 5, dtype=torch.long)}, {}, {}, "responses"),
        ({"old_log_probs": torch.zeros(4, 5, dtype=torch.float64)}, {}, {}, "old_log_probs"),
        ({}, {"uid": ["u0", "u1", "u2", "zz"]}, {}, "uid"),
        ({"uid": torch.zeros(4)}, {}, {}, "uid"),
        ({}, {}, {"step": 8}, "step"),
    ],
)
def test_union_conflict_names_key(tensors: dict, non_tensors: dict, meta: dict, key: str) -> None:
    b = make_batch()
    other = Batch(tensors, non_tensors, meta, batch_size=4)
    with pytest.raises(ValueError, match=f"conflict on (meta )?key '{key}'"):
        b.union(other)


def test_union_length_mismatch() -> None:
    with pytest.raises(ValueError, match="length 4 and 2"):
        make_batch(4).union(make_batch(2))


def test_concat_keeps_first_meta_and_checks_keys() -> None:
    a, b = make_batch(2), make_batch(3)
    b.meta["step"] = 100
    c = Batch.concat([a, b])
    assert len(c) == 5 and c.meta["step"] == 7
    assert torch.equal(c["responses"], torch.cat([a["responses"], b["responses"]]))
    assert uids(c) == uids(a) + uids(b)
    b.pop("extra_info")
    b["values"] = torch.zeros(3, 5)
    with pytest.raises(ValueError, match=r"batch 1's tensor keys.*extra \['values'\]"):
        Batch.concat([a, b])
    b.pop("values")
    with pytest.raises(ValueError, match=r"non-tensor keys.*missing \['extra_info'\]"):
        Batch.concat([a, b])


def test_concat_rejects_dtype_mismatch_and_empty() -> None:
    a = Batch.from_dict({"x": torch.zeros(2)})
    b = Batch.from_dict({"x": torch.zeros(2, dtype=torch.float64)})
    with pytest.raises(ValueError, match="'x'"):
        Batch.concat([a, b])
    with pytest.raises(ValueError, match="at least one"):
        Batch.concat([])


# ---- indexing ---------------------------------------------------------------------------------


def test_index_by_int_returns_length_one_batch() -> None:
    b = make_batch()
    row = b[2]
    assert isinstance(row, Batch) and len(row) == 1
    assert uids(row) == ["u2"] and torch.equal(row["responses"][0], b["responses"][2])
    assert uids(b[-1]) == ["u3"]
    assert uids(b[torch.tensor(1)]) == ["u1"]
    with pytest.raises(IndexError):
        b[4]


@pytest.mark.parametrize(
    ("index", "expected"),
    [
        (slice(1, 3), [1, 2]),
        (slice(None, None, 2), [0, 2]),
        (slice(None, None, -1), [3, 2, 1, 0]),
        ([3, 0, 0], [3, 0, 0]),
        (torch.tensor([2, 1]), [2, 1]),
        (np.array([1, 3]), [1, 3]),
        ([], []),
        (torch.tensor([True, False, False, True]), [0, 3]),
        (np.array([False, True, True, False]), [1, 2]),
        ([False, False, True, False], [2]),
    ],
)
def test_index_selects_samples(index: object, expected: list[int]) -> None:
    b = make_batch()
    s = b[index]
    assert uids(s) == [f"u{i}" for i in expected]
    assert torch.equal(s["responses"], b["responses"][expected])
    assert s["response_mask"].shape == (len(expected), 5)
    assert s.meta == b.meta


def test_slice_shares_storage_and_bad_mask_raises() -> None:
    b = make_batch()
    assert b[1:3]["responses"].data_ptr() == b["responses"][1:].data_ptr()
    with pytest.raises(IndexError, match="bool mask"):
        b[torch.tensor([True, False])]
    with pytest.raises(IndexError, match="out of range"):
        b[[0, 9]]


def test_reorder_in_place_and_rejects_non_permutations() -> None:
    b = make_batch()
    resp = b["responses"].clone()
    assert b.reorder([2, 0, 3, 1]) is None
    assert uids(b) == ["u2", "u0", "u3", "u1"]
    assert torch.equal(b["responses"], resp[[2, 0, 3, 1]])
    with pytest.raises(ValueError, match="permutation"):
        b.reorder([0, 0, 1, 2])


# ---- sharding and repeat ----------------------------------------------------------------------


def test_chunk_concat_identity_and_split() -> None:
    b = make_batch(6)
    shards = b.chunk(3)
    assert [uids(s) for s in shards] == [["u0", "u1"], ["u2", "u3"], ["u4", "u5"]]
    assert Batch.concat(shards).equals(b)
    assert [len(s) for s in b.split(2)] == [2, 2, 2]
    assert Batch.concat(b.split(3)).equals(b)


def test_chunk_not_divisible_raises() -> None:
    with pytest.raises(ValueError, match="5 samples is not divisible by 2"):
        make_batch(5).chunk(2)
    with pytest.raises(ValueError, match="not divisible by 3"):
        make_batch(5).split(3)


def test_pad_to_divisor_repeats_first_samples_like_verl() -> None:
    b = make_batch(5)
    padded, pad = pad_to_divisor(b, 4)
    assert pad == 3 and uids(padded) == ["u0", "u1", "u2", "u3", "u4", "u0", "u1", "u2"]
    small, pad = pad_to_divisor(make_batch(2), 8)
    assert pad == 6 and uids(small) == ["u0", "u1"] * 4
    same, pad = pad_to_divisor(b, 5)
    assert same is b and pad == 0
    assert unpad(padded, 3).equals(b)


def test_chunk_with_pad_then_unpad_round_trip() -> None:
    b = make_batch(5)
    shards = b.chunk(4, pad=True)
    assert [len(s) for s in shards] == [2, 2, 2, 2]
    merged = Batch.concat(shards)
    assert unpad(merged, -len(b) % 4).equals(b)
    assert Batch.concat(b.split(2, pad=True))[:5].equals(b)


def test_repeat_interleave_keeps_group_adjacent() -> None:
    b = make_batch(3)
    r = b.repeat(4, interleave=True)
    assert len(r) == 12
    assert uids(r) == [u for u in uids(b) for _ in range(4)]
    assert torch.equal(r["responses"], b["responses"].repeat_interleave(4, dim=0))
    flat = b.repeat(2, interleave=False)
    assert uids(flat) == uids(b) * 2
    assert flat["uid"][0] != flat["uid"][1]
    assert torch.equal(flat["old_log_probs"], b["old_log_probs"].repeat(2, 1))


# ---- devices ----------------------------------------------------------------------------------


def test_to_device_returns_new_batch() -> None:
    b = make_batch()
    moved = b.to("meta")
    assert moved["responses"].device.type == "meta" and b["responses"].device.type == "cpu"
    assert moved["uid"] is b["uid"] and moved.meta == b.meta
    assert b.to("cpu").equals(b)


# ---- serialization ----------------------------------------------------------------------------


def rich_batch() -> Batch:
    return Batch.from_dict(
        {
            "responses": torch.tensor([[1, 2, 3], [4, 5, 0]], dtype=torch.int64),
            "response_mask": torch.tensor([[True, True, True], [True, True, False]]),
            "advantages": torch.tensor(
                [[0.5, -1.25, 3e-3], [1e9, -0.0, 7.0]], dtype=torch.bfloat16
            ),
            "old_log_probs": torch.tensor([[-0.1, float("nan"), -3.0], [float("-inf"), 0, 1]]),
            "returns": torch.randn(2, 3, dtype=torch.float64),
            "turn_ids": torch.tensor([[1, 1, 2], [1, 0, 0]], dtype=torch.int32),
        },
        {
            "uid": ["a", "b"],
            "messages": [[{"role": "user", "content": "héllo ✓"}], []],
            "extra_info": [{"n": 1, "f": 0.1, "ok": True, "none": None}, {"nested": {"l": [1]}}],
            "ground_truth": [3, "x"],
        },
        {"step": 3, "temperature": 0.7, "flags": {"kl_in_reward": False}, "tags": ["a"]},
    )


def assert_exact(loaded: Batch, saved: Batch) -> None:
    assert loaded.keys() == saved.keys()
    for k, v in saved.tensors.items():
        assert loaded[k].dtype == v.dtype and loaded[k].shape == v.shape, k
    assert torch.equal(loaded["advantages"], saved["advantages"])
    assert torch.isnan(loaded["old_log_probs"][0, 1])
    assert loaded.equals(saved)
    for k in saved.non_tensors:
        assert loaded[k].dtype == object and loaded[k].tolist() == saved[k].tolist()
    assert loaded.meta == saved.meta


def test_save_load_round_trip_exact(tmp_path) -> None:
    b = rich_batch()
    b.save(tmp_path / "batch")
    assert sorted(p.name for p in (tmp_path / "batch").iterdir()) == [
        "batch.json",
        "tensors.safetensors",
    ]
    header = json.loads((tmp_path / "batch" / "batch.json").read_text())
    assert header["meta"] == b.meta and header["batch_size"] == 2
    assert_exact(Batch.load(tmp_path / "batch"), b)
    assert [p.name for p in tmp_path.iterdir()] == ["batch"]  # no temp dirs left


def test_to_bytes_round_trip_exact() -> None:
    b = rich_batch()
    data = b.to_bytes()
    assert data.startswith(b"CRLBATCH")
    assert_exact(Batch.from_bytes(data), b)
    with pytest.raises(ValueError, match="magic"):
        Batch.from_bytes(b"garbage" + data)


def test_save_overwrites_a_batch_but_not_other_directories(tmp_path) -> None:
    make_batch(4).save(tmp_path / "b")
    make_batch(2).save(tmp_path / "b")
    assert len(Batch.load(tmp_path / "b")) == 2
    other = tmp_path / "precious"
    other.mkdir()
    with pytest.raises(FileExistsError):
        make_batch().save(other)


def test_save_views_sharing_storage() -> None:
    ids = torch.arange(12).view(2, 6)
    b = Batch.from_dict({"input_ids": ids, "responses": ids[:, -2:], "prompts": ids[:, :4]})
    assert Batch.from_bytes(b.to_bytes()).equals(b)


@pytest.mark.parametrize(
    ("value", "where"),
    [
        (np.int64(3), r"'bad'\[1\]: int64"),
        ((1, 2), r"'bad'\[1\]: tuple"),
        ({"a": {1: "x"}}, r"'bad'\[1\]\['a'\]\[1\]: dict key of type int"),
        (torch.tensor(1.0), r"'bad'\[1\]: Tensor"),
        ([1, {"k": object()}], r"'bad'\[1\]\[1\]\['k'\]: object"),
    ],
)
def test_save_rejects_non_json_non_tensor(value: object, where: str, tmp_path) -> None:
    b = Batch.from_dict({"x": torch.zeros(2)}, {"bad": [None, value]})
    with pytest.raises(TypeError, match=where):
        b.to_bytes()
    with pytest.raises(TypeError, match=where):
        b.save(tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_save_rejects_non_json_meta() -> None:
    b = Batch.from_dict({"x": torch.zeros(2)}, meta={"lr": torch.tensor(0.1)})
    with pytest.raises(TypeError, match=r"meta\['lr'\]"):
        b.to_bytes()


def test_float_values_round_trip_bit_exact() -> None:
    vals = [0.1, 1 / 3, -0.0, 1e-310, math.inf]
    b = Batch.from_dict({}, {"v": vals}, {"lr": 3e-7})
    out = Batch.from_bytes(b.to_bytes())
    assert [math.copysign(1, x) for x in out["v"]] == [math.copysign(1, x) for x in vals]
    assert out["v"].tolist() == vals and out.meta["lr"] == 3e-7


# ---- catalogue --------------------------------------------------------------------------------


STANDARD = [
    "input_ids", "attention_mask", "position_ids", "prompts", "responses", "response_mask",
    "turn_ids", "rollout_log_probs", "old_log_probs", "ref_log_prob", "entropys", "values",
    "token_level_scores", "token_level_rewards", "advantages", "returns", "rm_scores",
    "reward_baselines", "rollout_is_weights", "uid", "data_source", "ground_truth",
    "extra_info", "reward_extra_info", "raw_prompt", "messages",
]  # fmt: skip


def test_catalogue_covers_standard_fields() -> None:
    for name in STANDARD:
        spec = FIELDS[name]
        assert isinstance(spec, FieldSpec) and spec.name == name
        assert spec.shape in {"(B,)", "(B, T)", "(B, P)", "(B, P+T)"}
        assert spec.meaning and spec.written_by and spec.dtype
        assert describe(name).startswith(f"{name} {spec.shape} {spec.dtype}: ")
    assert "s_{j+1}" in FIELDS["values"].meaning and "-T-1:-1" in FIELDS["old_log_probs"].meaning
    assert "observation" in FIELDS["response_mask"].meaning
    with pytest.raises(KeyError, match="not in the field catalogue"):
        describe("not_a_field")


def test_require_missing_and_shapes() -> None:
    b = make_batch()
    require(b, "responses", "response_mask", "uid", "input_ids")
    with pytest.raises(KeyError, match="'values'") as e:
        require(b, "responses", "values")
    assert describe("values") in str(e.value)
    b["advantages"] = torch.zeros(4, 6)
    with pytest.raises(
        ValueError, match=r"'advantages' has shape \(4, 6\), expected \(B, T\)"
    ) as e:
        require(b, "advantages")
    assert describe("advantages") in str(e.value)
    b["input_ids"] = torch.zeros(4, 7, dtype=torch.long)
    with pytest.raises(ValueError, match="'input_ids'"):
        require(b, "input_ids")
    b["reward_baselines"] = torch.zeros(4, 1)
    with pytest.raises(ValueError, match="'reward_baselines'"):
        require(b, "reward_baselines")
