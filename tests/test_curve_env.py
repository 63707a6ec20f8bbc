"""CURVE keys from the environment: a learner (``CREDITRL_CURVE_SERVER_SECRET`` and
``CREDITRL_CURVE_AUTHORIZED``) and a sampler (``CREDITRL_CURVE_SERVER_PUBLIC`` and
``CREDITRL_CURVE_SECRET``) that never read a key folder, as the Ray launcher starts its actors
on machines without one (``transport.curve_env``)."""

import shutil
from pathlib import Path

import pytest

from creditrl.asynchronous.messages import encode
from creditrl.asynchronous.transport import (
    CURVE_ENV,
    LEARNER_CURVE_ENV,
    LearnerSocket,
    SamplerSocket,
    curve_env,
    make_curve_keys,
    server_curve_keys,
    uses_curve,
)
from creditrl.config.schema import AsyncConfig
from creditrl.errors import ConfigError


def test_curve_env_carries_what_each_role_needs(tmp_path: Path) -> None:
    keys = make_curve_keys(tmp_path / "keys")
    learner, sampler = curve_env(AsyncConfig(curve_keys_dir=str(keys)))
    assert set(learner) == set(LEARNER_CURVE_ENV) and set(sampler) == set(CURVE_ENV)
    server = (keys / "server.key_secret").read_text()
    mine = (keys / "sampler.key_secret").read_text()
    assert f'secret-key = "{learner["CREDITRL_CURVE_SERVER_SECRET"]}"' in server
    assert f'public-key = "{sampler["CREDITRL_CURVE_SERVER_PUBLIC"]}"' in server
    assert f'secret-key = "{sampler["CREDITRL_CURVE_SECRET"]}"' in mine
    assert f'public-key = "{learner["CREDITRL_CURVE_AUTHORIZED"]}"' in mine  # the one authorized
    assert "secret" not in learner["CREDITRL_CURVE_AUTHORIZED"]
    assert curve_env(AsyncConfig()) == ({}, {})
    (keys / "sampler.key_secret").unlink()
    with pytest.raises(ConfigError, match=r"curve_keys_dir: CURVE key .*sampler.key_secret"):
        curve_env(AsyncConfig(curve_keys_dir=str(keys)))


def test_learner_and_sampler_authenticate_with_keys_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both sides take their keys from the environment after the folder is gone; a sampler
    whose key is not among the authorized ones is never heard."""
    keys = make_curve_keys(tmp_path / "keys")
    intruder = make_curve_keys(tmp_path / "other")
    shutil.copy(keys / "server.key", intruder / "server.key")  # knows the learner's public key
    learner_env, sampler_env = curve_env(AsyncConfig(curve_keys_dir=str(keys)))
    _, intruder_env = curve_env(AsyncConfig(curve_keys_dir=str(intruder)))
    shutil.rmtree(keys)
    for name, value in learner_env.items():
        monkeypatch.setenv(name, value)
    cfg = AsyncConfig(port=0)  # no curve_keys_dir anywhere
    assert uses_curve(cfg)
    learner = LearnerSocket(cfg)
    assert learner.auth is not None and learner.sock.curve_server
    monkeypatch.delenv(LEARNER_CURVE_ENV[0])
    monkeypatch.delenv(LEARNER_CURVE_ENV[1])
    sockets = []
    try:
        for sampler_id, env in (("s1", intruder_env), ("s0", sampler_env)):
            for name, value in env.items():
                monkeypatch.setenv(name, value)
            sockets.append(SamplerSocket(cfg, sampler_id, learner.port))
            assert sockets[-1].send(encode("hello", {"sampler_id": sampler_id}), timeout_s=2)
        sender, message = learner.recv(timeout_s=5)
        assert (sender, message.kind) == ("s0", "hello")
        assert learner.recv(timeout_s=1.0) is None  # the intruder's hello never arrives
    finally:
        for sock in sockets:
            sock.close()
        learner.close()


@pytest.mark.parametrize(
    ("secret", "authorized", "error"),
    [
        ("x" * 40, None, "CREDITRL_CURVE_SERVER_SECRET is set but CREDITRL_CURVE_AUTHORIZED"),
        ("short", "a" * 40, "CREDITRL_CURVE_SERVER_SECRET is not a CURVE key"),
        (None, "a" * 40, "CREDITRL_CURVE_AUTHORIZED is set but CREDITRL_CURVE_SERVER_SECRET"),
    ],
)
def test_a_malformed_learner_environment_is_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, secret: str | None, authorized: str | None, error: str
) -> None:
    for name, value in zip(LEARNER_CURVE_ENV, (secret, authorized), strict=True):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=error):
        server_curve_keys(AsyncConfig())


def test_a_bad_authorized_key_is_refused_before_the_socket_binds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    keys = make_curve_keys(tmp_path / "keys")
    learner_env, _ = curve_env(AsyncConfig(curve_keys_dir=str(keys)))
    monkeypatch.setenv(LEARNER_CURVE_ENV[0], learner_env[LEARNER_CURVE_ENV[0]])
    monkeypatch.setenv(LEARNER_CURVE_ENV[1], learner_env[LEARNER_CURVE_ENV[1]] + ", not-a-key")
    with pytest.raises(ConfigError, match=r"CREDITRL_CURVE_AUTHORIZED \(key 1\) is not a CURVE"):
        LearnerSocket(AsyncConfig(port=0))
