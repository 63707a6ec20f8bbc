"""The newer wire fields of the async pair as an attacker would send them (issue 50, round 5):
``token_weight_version`` (partial rollout), ``rollout_kept_counts`` (sampling replay) and the
learner's ``weight_version``, ``queued`` and ``incarnation`` in welcome and ack messages. A
forged, out-of-range or inconsistent value is a counted, logged rejection of that group (or a
skipped message on the sampler) and the run goes on: the next group is accepted and a step
trains (docs/security.md, "Round 5 probes")."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest
import torch
from helpers import model_group, tiny_learner_config

from creditrl.asynchronous.learner import Learner
from creditrl.asynchronous.messages import (
    PROTOCOL,
    MessageError,
    ack_message,
    decode,
    encode,
    episode_ids,
    episodes_message,
)
from creditrl.asynchronous.sampler import Sampler
from creditrl.asynchronous.settings import max_message_bytes
from creditrl.asynchronous.transport import LearnerSocket, SamplerSocket
from creditrl.asynchronous.validation import REASONS
from creditrl.batch import Batch

TOP_K = 20
RUN = [
    "data.train_size=8", "data.val_size=0", "data.max_prompt_length=128", "data.few_shot=0",
    "rollout.max_response_length=8", "reward.num_workers=0", "trainer.rollout_dump_rows=0",
    "asynchronous.max_rejects=1000", "asynchronous.partial_rollout=true",
    "rollout.sampling_replay=true", f"rollout.top_k={TOP_K}",
]  # fmt: skip


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    """A learner of a partial-rollout run with sampling replay (top-k): its groups carry
    token_weight_version and rollout_kept_counts."""
    cfg = tiny_learner_config(tmp_path_factory.mktemp("learner"), *RUN)
    learner = Learner(cfg)
    learner.socket = LearnerSocket(cfg.asynchronous, 0, max_message_bytes(cfg))
    yield learner
    learner.socket.close()


def group(model, sid: str, seq: int) -> Batch:
    """A valid group of this run: version 0 on every token, kept sets of TOP_K tokens."""
    g = model_group(model, sid, seq, 0)
    mask = g["response_mask"]
    g["token_weight_version"] = torch.zeros_like(mask)
    g["rollout_kept_counts"] = TOP_K * mask
    return g


def frames(g: Batch, sid: str, seq: int) -> list[bytes]:
    header = {"sampler_id": sid, "seq": seq, "weight_version": 0,
              "episode_ids": episode_ids(sid, seq, len(g))}  # fmt: skip
    return encode("episodes", header, g.to_bytes())


def at(name: str, value, row: int = 0, col: int = 0):
    """Set ``name[row, col] = value``."""

    def change(g: Batch) -> None:
        g[name] = g[name].clone()
        g[name][row, col] = value

    return change


def replace(name: str, fn):
    def change(g: Batch) -> None:
        g[name] = fn(g[name])

    return change


def drop(name: str):
    def change(g: Batch) -> Batch:
        return Batch({k: v for k, v in g.tensors.items() if k != name}, g.non_tensors, g.meta)

    return change


# name -> (change to a valid group, the rejection's reason)
CASES = {
    "token version newer than the learner's": (at("token_weight_version", 1), "version"),
    "negative token version": (at("token_weight_version", -1), "value"),
    "token version 2**62": (at("token_weight_version", 2**62, col=3), "version"),
    "token version on padding": (at("token_weight_version", 5, row=1, col=3), "value"),
    "token versions as floats (NaN)": (
        replace("token_weight_version", lambda x: torch.full(x.shape, float("nan"))), "dtype"),
    "token versions one column short": (
        replace("token_weight_version", lambda x: x[:, :-1].clone()), "shape"),
    "no token versions in a partial-rollout run": (drop("token_weight_version"), "fields"),
    "kept count 0 for a sampled token": (at("rollout_kept_counts", 0), "value"),
    "negative kept count": (at("rollout_kept_counts", -5), "value"),
    "kept set larger than the vocabulary": (at("rollout_kept_counts", 49153), "value"),
    "kept counts as floats": (replace("rollout_kept_counts", lambda x: x.float()), "dtype"),
    "kept counts as int32": (replace("rollout_kept_counts", lambda x: x.int()), "dtype"),
    "kept counts of another shape": (
        replace("rollout_kept_counts", lambda x: torch.cat([x, x], 1)), "shape"),
    "no kept counts in a replay run": (drop("rollout_kept_counts"), "fields"),
}  # fmt: skip


def _acks(sock: SamplerSocket) -> list[dict]:
    message = sock.recv(5.0)
    assert message is not None and message.kind == "ack", message
    return message.header["acks"]


@pytest.mark.parametrize("case", list(CASES))
def test_a_forged_wire_field_is_a_counted_rejection_of_its_group(learner, case, caplog) -> None:
    change, reason = CASES[case]
    assert reason in REASONS
    sid = f"w{list(CASES).index(case)}"
    model = learner.actor.model
    before = dict(learner.counters)
    sock = SamplerSocket(learner.cfg.asynchronous, sid, port=learner.socket.port)
    try:
        bad = group(model, sid, 0)
        bad = change(bad) or bad
        with caplog.at_level(logging.WARNING):
            assert sock.send(frames(bad, sid, 0), timeout_s=5)
            assert learner._receive(5.0) == 0
        assert _acks(sock) == [{"seq": 0, "status": "rejected", "reason": reason}]
        assert learner.counters["rejected"] == before.get("rejected", 0) + 1
        assert learner.counters[f"rejected/{reason}"] == before.get(f"rejected/{reason}", 0) + 1
        assert any(f"{sid}:0" in r.getMessage() for r in caplog.records)
        assert sock.send(episodes_message(sid, 1, group(model, sid, 1)), timeout_s=5)
        assert learner._receive(5.0) == 1
        assert learner.buffer.holds(sid, 1)
    finally:
        sock.close()
        learner.buffer.take(len(learner.buffer))


def test_forged_groups_never_stop_training(learner) -> None:
    """Forged token versions and kept counts between two valid groups: the step trains on the
    valid ones and reports the rejections."""
    model = learner.actor.model
    sock = SamplerSocket(learner.cfg.asynchronous, "t0", port=learner.socket.port)
    try:
        newer, empty = group(model, "t0", 1), group(model, "t0", 2)
        at("token_weight_version", 7)(newer)
        at("rollout_kept_counts", 0, row=1, col=2)(empty)
        good = [episodes_message("t0", seq, group(model, "t0", seq)) for seq in (0, 3)]
        for message in (good[0], frames(newer, "t0", 1), frames(empty, "t0", 2), good[1]):
            assert sock.send(message, timeout_s=5)
        learner.step += 1
        metrics = learner.train_step()
        acks = _acks(sock) + _acks(sock) + _acks(sock)
        assert {"seq": 1, "status": "rejected", "reason": "version"} in acks
        assert {"seq": 2, "status": "rejected", "reason": "value"} in acks
        assert [a for a in acks if a["status"] == "trained"] == [
            {"seq": 0, "status": "trained"}, {"seq": 3, "status": "trained"}]  # fmt: skip
        assert metrics["async/rejected/version"] >= 1 and metrics["async/rejected/value"] >= 1
        assert all(torch.isfinite(p).all() for p in learner.actor.model.parameters())
    finally:
        sock.close()


# ---- what the learner tells a sampler ------------------------------------------------------

WELCOME = {"incarnation": "inc", "weight_version": 3, "queued": 1}


@pytest.mark.parametrize("kind", ["welcome", "ack"])
@pytest.mark.parametrize(
    "forged",
    [
        {"weight_version": -1},
        {"weight_version": 10**30},  # the sampler would wait for ever for that version
        {"weight_version": float("nan")},
        {"weight_version": "3"},
        {"weight_version": None},
        {"queued": 2**60},
        {"queued": -2},
        {"queued": 1.5},
        {"incarnation": ""},
        {"incarnation": ["x"]},
        {"incarnation": "x" * 65},
    ],
    ids=lambda forged: ",".join(f"{k}={str(v)[:12]}" for k, v in forged.items()),
)
def test_a_forged_welcome_or_ack_is_skipped_by_the_sampler(kind, forged, caplog) -> None:
    """A welcome or ack whose version, queue or incarnation is forged fails to decode; the
    sampler logs it, skips it and keeps what it last heard (before: any int was taken as the
    learner's version, e.g. 10**30, and the sampler waited for fresher weights for ever)."""
    header = {**WELCOME, **forged, **({"acks": []} if kind == "ack" else {})}
    if header["weight_version"] is None:
        del header["weight_version"]
    # json.dumps as a forger would (NaN allowed), not encode(), which refuses NaN
    forged_frames = [PROTOCOL, json.dumps({**header, "kind": kind}).encode()]
    with pytest.raises(MessageError):
        decode(forged_frames)
    queue = [forged_frames, ack_message("inc", 4, [], queued=2)]

    def recv(timeout_s: float):
        return decode(queue.pop(0)) if queue else None

    sampler = SimpleNamespace(sampler_id="s0", socket=SimpleNamespace(recv=recv),
                              last_heard=0.0, incarnation="inc", learner_version=2,
                              others_queued=0)  # fmt: skip
    sampler._on_message = lambda message: Sampler._on_message(sampler, message)
    with caplog.at_level(logging.WARNING):
        assert Sampler._drain(sampler, 0.0)
    assert (sampler.learner_version, sampler.others_queued) == (4, 2)
    assert any("bad message from the learner skipped" in r.getMessage() for r in caplog.records)
