"""The learner's buffer follows the samplers that deliver (issue 53): a sampler that joins past
``asynchronous.num_samplers`` gets room for its unacknowledged groups instead of buffer_full,
up to ``BUFFER_GROWTH`` x ``num_samplers`` samplers."""

from pathlib import Path
from types import SimpleNamespace

import pytest
from helpers import Recorder, synthetic_group
from rich.console import Console

from creditrl.asynchronous.messages import decode, episodes_message
from creditrl.asynchronous.receiver import BUFFER_GROWTH, GroupReceiver
from creditrl.asynchronous.settings import inflight_groups, max_buffered_bytes
from creditrl.asynchronous.validation import max_group_bytes
from creditrl.config import load_config

PER_SAMPLER = 3  # unacknowledged groups per sampler in this test's run


class Receiver(GroupReceiver):
    """The learner's receiving side alone: no model, version 0, groups of 2 answers."""

    def __init__(self, out: Path, *extra: str) -> None:
        self.cfg = load_config(overrides=[
            "rollout.n=2", "rollout.temperature=1.0", "data.train_batch_size=2",
            "actor.ppo_mini_batch_size=2",
            f"asynchronous.max_inflight_groups={PER_SAMPLER - 1}",
            "asynchronous.sampler_batch_groups=2", *extra,
        ])  # fmt: skip
        self.step = 0
        self.weights = SimpleNamespace(version=0)
        self.console = Console(file=(out / "said.txt").open("w"), width=300)
        self.init_receiving(self.cfg, vocab_size=1024, out=out)
        self.socket = Recorder()

    def deliver(self, sampler_id: str, seq: int) -> int:
        message = decode(episodes_message(sampler_id, seq, synthetic_group(sampler_id, seq)))
        return self._handle(sampler_id, message)


def test_the_bound_is_room_for_the_samplers_that_deliver_and_at_most_four_times_it(
    tmp_path: Path,
) -> None:
    """Room for one sampler = its unacknowledged groups at the largest size; the bound is
    max_buffered_bytes for num_samplers samplers, plus that room for each sampler past them
    whose groups are buffered (the sender included), never more than BUFFER_GROWTH of it."""
    receiver = Receiver(tmp_path, "asynchronous.num_samplers=2")
    cfg = receiver.cfg
    assert inflight_groups(cfg) == PER_SAMPLER
    largest = max_group_bytes(2, cfg.data.max_prompt_length, cfg.rollout.max_response_length,
                              receiver.json_limits)  # fmt: skip
    assert receiver.sampler_room == PER_SAMPLER * largest
    assert receiver.buffer_limit == max_buffered_bytes(cfg) == 2 * PER_SAMPLER * largest
    assert receiver.buffer_bound("s0") == receiver.buffer_bound("s9") == receiver.buffer_limit
    for i in range(BUFFER_GROWTH * 2 + 3):
        assert receiver.deliver(f"s{i}", 0) == 1
        holders = min(i + 1, BUFFER_GROWTH * 2)
        extra = max(holders - 2, 0) * receiver.sampler_room
        assert receiver.buffer_bound("s0") == receiver.buffer_limit + extra
        assert receiver.buffer_bound(f"s{i + 1}") <= BUFFER_GROWTH * receiver.buffer_limit
    receiver.buffer.take(len(receiver.buffer))
    assert receiver.buffer_bound("s0") == receiver.buffer_limit


@pytest.mark.parametrize("joiners", [1, BUFFER_GROWTH - 1])
def test_a_sampler_that_joins_past_num_samplers_is_not_refused_buffer_full(
    tmp_path: Path, joiners: int
) -> None:
    """num_samplers=1; the room of one sampler is set to its 3 unacknowledged groups, s0 fills
    it. Each joiner's 3 groups are buffered, not refused; a 4th group of s0 past its room is
    refused buffer_full, as is a joiner past BUFFER_GROWTH samplers."""
    receiver = Receiver(tmp_path)
    one = decode(episodes_message("s0", 0, synthetic_group("s0", 0))).nbytes
    receiver.buffer_limit = receiver.sampler_room = PER_SAMPLER * one  # groups of one size
    for seq in range(PER_SAMPLER):
        assert receiver.deliver("s0", seq) == 1
    for j in range(1, joiners + 1):
        for seq in range(PER_SAMPLER):
            assert receiver.deliver(f"j{j}", seq) == 1, receiver.last_rejection
    assert len(receiver.buffer) == PER_SAMPLER * (joiners + 1)
    assert receiver.counters["rejected"] == 0
    late = "j9" if joiners + 1 == BUFFER_GROWTH else "s0"  # past the growth, or past its room
    assert receiver.deliver(late, 7) == 0
    assert receiver.counters["rejected/buffer_full"] == 1 and receiver.rejects[late] == 0
    assert f"(buffer_full): group {late}:7 of {one} bytes" in receiver.last_rejection
    sampler_id, message = receiver.socket.sent[-1]
    assert sampler_id == late and message.header["acks"] == [
        {"seq": 7, "status": "rejected", "reason": "buffer_full"}
    ]
