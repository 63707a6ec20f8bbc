"""The fleet's counts survive a learner's restart (issue 53): saved with each checkpoint,
checked when read back (a checkpoint is a file), continued by the resumed learner."""

from pathlib import Path

import pytest
from helpers import Recorder, tiny_learner_config

from creditrl.asynchronous.fleet import MAX_SAVED, Fleet
from creditrl.asynchronous.learner import Learner
from creditrl.asynchronous.messages import Message, decode, encode
from creditrl.errors import DataError


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _hello(sampler_id: str, started: str) -> Message:
    return decode(encode("hello", {"sampler_id": sampler_id, "started": started, "pending": []}))


def _a_fleet(fleet: Fleet) -> None:
    """s0: 2 groups up to seq 5, one restart; s1 (no started id): 1 group."""
    fleet.heard("s0", "a")
    fleet.delivered("s0", 4)
    fleet.heard("s0", "b")
    fleet.delivered("s0", 5)
    fleet.delivered("s1", 0)


def test_a_saved_fleet_comes_back_known_and_not_alive() -> None:
    clock = Clock()
    fleet = Fleet(clock)
    _a_fleet(fleet)
    clock.now = 130.0
    state = fleet.state_dict()
    assert state == {"members": [
        {"id": "s0", "started": "b", "restarts": 1, "groups": 2, "next_seq": 6, "silent_s": 30.0},
        {"id": "s1", "started": None, "restarts": 0, "groups": 1, "next_seq": 1, "silent_s": 30.0},
    ]}  # fmt: skip
    later = Clock()
    later.now = 5.0  # another process's monotonic clock
    resumed = Fleet(later)
    resumed.load_state_dict(state)
    m = resumed.metrics()
    assert m["fleet/known"] == 2 and m["fleet/alive"] == 0 and m["fleet/restarts"] == 1
    assert m["fleet/groups_delivered"] == 3 and m["fleet/s0/groups_delivered"] == 2
    assert m["fleet/s0/last_heard_s"] == 30.0  # the silence continues from the one saved
    assert resumed.heard("s0", "b") == "back"  # the same process, reconnected
    assert resumed.heard("s1", "x") == "back"  # its first started id
    assert resumed.heard("s0", "c") == "restarted"
    resumed.delivered("s1", 1)
    m = resumed.metrics()
    assert m["fleet/restarts"] == 2 and m["fleet/groups_delivered"] == 4 and m["fleet/alive"] == 2


def test_a_checkpoint_keeps_the_samplers_heard_most_recently() -> None:
    clock = Clock()
    fleet = Fleet(clock)
    for i in range(MAX_SAVED + 2):
        clock.now = 100.0 + i
        fleet.heard(f"s{i}")
    saved = {m["id"] for m in fleet.state_dict()["members"]}
    assert len(saved) == MAX_SAVED and "s0" not in saved and "s1" not in saved
    assert f"s{MAX_SAVED + 1}" in saved


GOOD = {"id": "s0", "started": "a", "restarts": 1, "groups": 2, "next_seq": 6, "silent_s": 1.5}


@pytest.mark.parametrize(
    "state,why",
    [
        (None, "'members' must be a list"),
        ({"members": {"s0": GOOD}}, "'members' must be a list"),
        ({"members": [GOOD] * (MAX_SAVED + 1)}, f"at most {MAX_SAVED} samplers"),
        ({"members": ["s0"]}, r"members\[0\] must hold exactly"),
        ({"members": [{**GOOD, "alive": True}]}, r"members\[0\] must hold exactly"),
        ({"members": [{k: v for k, v in GOOD.items() if k != "started"}]}, "must hold exactly"),
        ({"members": [{**GOOD, "id": "../x"}]}, r"members\[0\]\.id must be 1-64 characters"),
        ({"members": [{**GOOD, "id": "x" * 65}]}, r"\.id must be 1-64"),
        ({"members": [{**GOOD, "started": 7}]}, r"\.started must be 1-64"),
        ({"members": [GOOD, GOOD]}, r"members\[1\]: sampler s0 appears twice"),
        ({"members": [{**GOOD, "restarts": -1}]}, r"\.restarts must be an int in \[0, 2\*\*53\]"),
        ({"members": [{**GOOD, "groups": 2**53 + 1}]}, r"\.groups must be an int"),
        ({"members": [{**GOOD, "next_seq": 1.0}]}, r"\.next_seq must be an int"),
        ({"members": [{**GOOD, "groups": True}]}, r"\.groups must be an int"),
        ({"members": [{**GOOD, "silent_s": float("nan")}]}, r"\.silent_s must be a number"),
        ({"members": [{**GOOD, "silent_s": -1}]}, r"\.silent_s must be a number"),
        ({"members": [{**GOOD, "silent_s": "1"}]}, r"\.silent_s must be a number"),
    ],
)
def test_a_saved_fleet_that_is_not_one_is_refused_in_one_line(state: object, why: str) -> None:
    fleet = Fleet(Clock())
    fleet.heard("kept")
    with pytest.raises(ValueError, match=why) as err:
        fleet.load_state_dict(state)
    assert "\n" not in str(err.value)
    assert list(fleet.members) == ["kept"]  # nothing half-restored


def test_a_resumed_learner_continues_the_fleet_counts(tmp_path: Path) -> None:
    """A learner saves a checkpoint at step 2 and stops; the one that resumes from it reports
    the fleet's counts as they were (none alive), welcomes s0 with the seq it had reached,
    and counts on from there: s0 in a new process is its second restart."""
    cfg = tiny_learner_config(tmp_path)
    first = Learner(cfg)
    try:
        _a_fleet(first.fleet)
        first.step = 2
        saved = first.save_checkpoint()
    finally:
        first.close()
    second = Learner(cfg)
    try:
        assert second.maybe_resume() and second.step == 2
        m = second.receiving_metrics()
        assert m["fleet/known"] == 2 and m["fleet/alive"] == 0 and m["fleet/restarts"] == 1
        assert m["fleet/groups_delivered"] == 3 and m["fleet/s1/groups_delivered"] == 1
        second.socket = socket = Recorder()
        second._handle("s0", _hello("s0", "c"))
        assert socket.sent[-1][1].kind == "welcome"
        assert socket.sent[-1][1].header["next_seq"] == 6
        m = second.receiving_metrics()
        assert m["fleet/restarts"] == 2 and m["fleet/s0/restarts"] == 2
        assert m["fleet/alive"] == 1 and m["fleet/known"] == 2
        with pytest.raises(DataError, match=rf"checkpoint {saved}: state.json's fleet: members"):
            second.restore_fleet(saved, {"fleet": {"members": [{**GOOD, "groups": -1}]}})
        second.restore_fleet(saved, {})  # a checkpoint from before fleets were saved
        assert second.fleet.metrics()["fleet/restarts"] == 2
    finally:
        second.socket = None
        second.close()
