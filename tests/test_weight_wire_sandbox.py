"""Issue 53's acceptance: a `creditrl sampler` that cannot read the learner's output folder
(a bwrap sandbox: the root read-only, the learner's output folder and the key folder hidden
under empty tmpfs mounts, only the sampler's own folder writable) trains with the learner
over 127.0.0.1 with CURVE keys given in its environment: 3 steps, each new version fetched
over the weight port and sampled (the version in the sampler's records and the learner's)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from creditrl.asynchronous.launcher import free_port
from creditrl.asynchronous.transport import CURVE_ENV, make_curve_keys
from creditrl.models.tiny import tiny_model_dir

BWRAP = shutil.which("bwrap")


def _sandbox(hidden: list[Path], own: Path) -> list[str]:
    args = [BWRAP, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--die-with-parent"]
    for path in hidden:
        args += ["--tmpfs", str(path)]
    return [*args, "--bind", str(own), str(own)]


def _bwrap_works(tmp_path: Path) -> str | None:
    if BWRAP is None:
        return "bwrap is not installed"
    (tmp_path / "probe").mkdir()
    probe = subprocess.run([*_sandbox([tmp_path / "probe"], tmp_path / "probe"), "true"],
                           capture_output=True, text=True, timeout=60)  # fmt: skip
    if probe.returncode != 0:
        return f"bwrap cannot create its namespaces here: {probe.stderr.strip()[:200]}"
    return None


def _key(path: Path, line: str) -> str:
    return path.read_text().split(f'{line} = "')[1].split('"')[0]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_sampler_that_cannot_see_the_learners_disk_trains_over_the_wire(tmp_path: Path) -> None:
    reason = _bwrap_works(tmp_path)
    if reason is not None:
        pytest.skip(reason)
    out, own, keys = tmp_path / "out", tmp_path / "own", tmp_path / "keys"
    out.mkdir()
    (own / "tmp").mkdir(parents=True)
    make_curve_keys(keys)
    port, wport = free_port(), free_port()
    while wport == port:  # two free ports drawn one after the other may be the same one
        wport = free_port()
    common = [
        f"model.path={tiny_model_dir()}", "actor.autocast=none", "data.train_size=8",
        "data.val_size=2", "data.train_batch_size=2", "rollout.n=2",
        "rollout.max_response_length=8", "rollout.temperature=1.0",
        "actor.ppo_mini_batch_size=1", "actor.ppo_micro_batch_size=2", "actor.optim.lr=1e-3",
        "reward.num_workers=0", "trainer.total_steps=3", "trainer.save_freq=0",
        "trainer.test_freq=0", "trainer.val_before_train=false", "trainer.logger=[jsonl]",
        "trainer.num_threads=1", f"trainer.output_dir={out}", f"asynchronous.port={port}",
        f"asynchronous.weight_port={wport}", "asynchronous.weight_channel=wire",
        "asynchronous.max_staleness=0", "asynchronous.ping_s=1", "asynchronous.data_timeout_s=240",
    ]  # fmt: skip
    cli = [sys.executable, "-m", "creditrl.cli"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("CREDITRL_CURVE")}
    learner = subprocess.Popen(
        [*cli, "learner", *common, f"asynchronous.curve_keys_dir={keys}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    sampler_env = {
        **env,
        CURVE_ENV[0]: _key(keys / "server.key", "public-key"),
        CURVE_ENV[1]: _key(keys / "sampler.key_secret", "secret-key"),
        "TMPDIR": str(own / "tmp"),
        "HOME": str(own),
    }
    sandbox = _sandbox([out, keys], own)
    try:
        deadline = time.monotonic() + 120
        while not (out / "weights").is_dir() and time.monotonic() < deadline:
            time.sleep(0.2)
        seen = subprocess.run(
            [*sandbox, sys.executable, "-c",
             "import os, sys; print(sorted(os.listdir(sys.argv[1])), os.path.exists(sys.argv[2]))",
             str(out), str(keys / "server.key_secret")],
            capture_output=True, text=True, timeout=60, env=sampler_env,
        )  # fmt: skip
        assert seen.stdout.split() == ["[]", "False"], seen.stdout + seen.stderr
        sampler = subprocess.run(
            [*sandbox, *cli, "sampler", *common, f"asynchronous.state_dir={own / 'state'}"],
            capture_output=True, text=True, timeout=400, env=sampler_env,
        )  # fmt: skip
        learned, _ = learner.communicate(timeout=120)
    finally:
        if learner.poll() is None:
            learner.kill()
            learner.wait()
    said = sampler.stdout + sampler.stderr
    assert learner.returncode == 0, learned[-3000:]
    assert sampler.returncode == 0, said[-3000:]
    assert (f"sampler s0: weights over the wire from tcp://127.0.0.1:{wport} "
            "(asynchronous.weight_channel=wire)") in said  # fmt: skip
    assert f"learner: serving weights over the wire on tcp://127.0.0.1:{wport}" in learned
    sampled = _records(own / "state" / "s0" / "metrics.jsonl")
    versions = [r["sampler/weight_version"] for r in sampled]
    # each version trained on sampled; v3 too when it arrived before the learner's stop
    assert sorted(set(versions)) in ([0.0, 1.0, 2.0], [0.0, 1.0, 2.0, 3.0]), versions
    assert versions == sorted(versions)
    assert sampled[-1]["sampler/weights_chunks_fetched"] > 0
    assert all(r.get("sampler/weights_refused", 0) == 0 for r in sampled)
    trained = [r for r in _records(out / "metrics.jsonl") if "async/weight_version" in r]
    assert [r["async/weight_version"] for r in trained] == [1.0, 2.0, 3.0]
    assert all(r["async/staleness/mean"] == 0 for r in trained)  # trained on v0, v1, v2
    # the chunks of v1 and v2 the sampler fetched were sent by the learner before its last step
    # (v3's may still have been on their way when it logged that step)
    before_v3 = max(r["sampler/weights_chunks_fetched"] for r in sampled
                    if r["sampler/weight_version"] <= 2.0)  # fmt: skip
    assert 0 < before_v3 <= trained[-1]["async/weights_chunks_sent"], (before_v3, trained[-1])
    box = own / "state" / "s0"
    produced = json.loads((box / "state.json").read_text())["next_seq"]
    acked = [json.loads(line)["seq"] for line in (box / "acks.jsonl").read_text().splitlines()]
    outbox = box / "outbox"
    pending = [int(p.name) for p in outbox.iterdir() if p.name.isdigit()] if outbox.exists() else []
    assert len(acked) == len(set(acked)) and set(acked).isdisjoint(pending)
    assert sorted([*acked, *pending]) == list(range(produced))  # each group acknowledged or kept
    # unacknowledged only what was sampled on the last version, after the learner's last step:
    # past the 3 steps' 2 groups each (data.train_batch_size=2), 2 per batch sampled on v3
    assert all(seq >= 3 * 2 for seq in pending), pending
    assert len(pending) <= 2 * sum(v == 3.0 for v in versions), (pending, versions)
