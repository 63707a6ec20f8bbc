"""Each sampler sees the learner's whole queue: the groups of other samplers waiting ahead of
its next batch count toward the staleness it would be trained at."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from helpers import model_group as make_group
from helpers import tiny_learner_config

from creditrl.asynchronous.learner import Learner
from creditrl.asynchronous.messages import (
    MessageError,
    ack_message,
    decode,
    encode,
    episodes_message,
)
from creditrl.asynchronous.sampler import Sampler
from creditrl.asynchronous.settings import max_message_bytes
from creditrl.asynchronous.staleness import BufferedGroup, GroupBuffer
from creditrl.asynchronous.transport import LearnerSocket, SamplerSocket

RUN = ["data.train_size=8", "data.val_size=0", "rollout.max_response_length=8",
       "reward.num_workers=0", "trainer.rollout_dump_rows=0"]  # fmt: skip


def test_queued_travels_in_welcome_and_ack_and_is_checked() -> None:
    assert decode(ack_message("inc", 3, [(7, "trained")], queued=5)).header["queued"] == 5
    empty = decode(ack_message("inc", 4, [], queued=2))
    assert empty.header["acks"] == [] and empty.header["weight_version"] == 4
    welcome = {"incarnation": "inc", "weight_version": 0, "queued": 1}
    assert decode(encode("welcome", welcome)).header["queued"] == 1
    for bad in (-1, "3", True, 2**53, 1.5):
        for kind in ("welcome", "ack"):
            header = {**welcome, "queued": bad, **({"acks": []} if kind == "ack" else {})}
            with pytest.raises(MessageError, match="'queued' must be an int"):
                decode(encode(kind, header))


def _group(sampler_id: str, seq: int) -> BufferedGroup:
    return BufferedGroup(sampler_id=sampler_id, seq=seq, version=0, batch=[], nbytes=0)


def test_the_buffer_counts_the_groups_of_other_samplers() -> None:
    buffer = GroupBuffer(max_staleness=1)
    for sampler_id, seq in (("a", 0), ("b", 0), ("a", 1), ("c", 0)):
        buffer.add(_group(sampler_id, seq))
    assert [buffer.held_for_others(s) for s in ("a", "b", "c", "d")] == [2, 3, 3, 4]


def _gate(pending: int, others_queued: int, max_staleness: int, samplers: int = 1) -> bool:
    a = SimpleNamespace(max_staleness=max_staleness, num_samplers=samplers)
    cfg = SimpleNamespace(data=SimpleNamespace(train_batch_size=2), asynchronous=a)
    sampler = SimpleNamespace(
        cfg=cfg, outbox=SimpleNamespace(pending=lambda: list(range(pending))),
        others_queued=others_queued, learner_version=3, version=3,
    )  # fmt: skip
    return Sampler._fresh_enough(sampler)


def test_the_sampler_waits_for_groups_of_other_samplers_ahead_of_it() -> None:
    """2 groups a step: at max_staleness 0 a sampler with nothing of its own pending samples
    while the learner holds less than a step of the others' groups, and waits once it holds a
    whole step (before: it sampled, and its batch arrived one version stale)."""
    assert _gate(pending=0, others_queued=1, max_staleness=0)
    assert not _gate(pending=0, others_queued=2, max_staleness=0)
    assert not _gate(pending=1, others_queued=1, max_staleness=0)
    assert _gate(pending=1, others_queued=2, max_staleness=1)
    assert not _gate(pending=2, others_queued=2, max_staleness=1)


def test_before_the_learner_reports_a_sampler_counts_the_others_as_busy_as_itself() -> None:
    """The learner reads messages only between steps: while it reports nothing queued, each of
    the other samplers is taken to have as many groups in flight as this one."""
    assert _gate(pending=1, others_queued=0, max_staleness=0, samplers=1)
    assert not _gate(pending=1, others_queued=0, max_staleness=0, samplers=2)
    assert _gate(pending=1, others_queued=0, max_staleness=1, samplers=3)
    assert not _gate(pending=1, others_queued=0, max_staleness=1, samplers=4)
    assert not _gate(pending=2, others_queued=0, max_staleness=1, samplers=2)


def test_the_sampler_keeps_the_queue_it_last_heard() -> None:
    sampler = SimpleNamespace(last_heard=0.0, incarnation="inc", learner_version=0,
                              others_queued=0)  # fmt: skip
    Sampler._on_message(sampler, decode(ack_message("inc", 4, [], queued=3)))
    assert (sampler.learner_version, sampler.others_queued) == (4, 3)
    welcome = {"incarnation": "inc", "weight_version": 5, "queued": 0}
    Sampler._on_message(sampler, decode(encode("welcome", welcome)))
    assert (sampler.learner_version, sampler.others_queued) == (5, 0)


def _recv(sock: SamplerSocket):
    message = sock.recv(5.0)
    assert message is not None
    return message


def test_the_learner_tells_every_sampler_its_queue(tmp_path) -> None:
    """s2 said hello and sent nothing; s1 sent 3 groups (2 a step). s2's welcome counts them;
    after a step of s1's groups, s1's ack counts none of its own and s2 hears of the one
    left, in an empty ack carrying the new version."""
    cfg = tiny_learner_config(tmp_path, *RUN)
    learner = Learner(cfg)
    learner.socket = LearnerSocket(cfg.asynchronous, 0, max_message_bytes(cfg))
    s1 = SamplerSocket(cfg.asynchronous, "s1", port=learner.socket.port)
    s2 = SamplerSocket(cfg.asynchronous, "s2", port=learner.socket.port)
    try:
        model = learner.actor.model
        for seq in range(3):
            assert s1.send(episodes_message("s1", seq, make_group(model, "s1", seq, 0)), 5)
        received = 0
        while received < 3:
            received += learner._receive(5.0)
        assert s2.send(encode("hello", {"sampler_id": "s2", "pending": 0}), 5)
        while "s2" not in learner.samplers:
            learner._receive(5.0)
        assert _recv(s2).header["queued"] == 3
        taken = learner.collect()
        assert [(g.sampler_id, g.seq) for g in taken] == [("s1", 0), ("s1", 1)]
        learner.version += 1
        learner.acknowledge_trained(taken)
        ack = _recv(s1).header
        assert [a["seq"] for a in ack["acks"]] == [0, 1] and ack["queued"] == 0
        note = _recv(s2).header
        assert note["acks"] == [] and note["queued"] == 1 and note["weight_version"] == 1
    finally:
        s1.close()
        s2.close()
        learner.socket.close()
