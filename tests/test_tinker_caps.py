"""``creditrl serve-tinker``'s caps on what one service holds (issue 50, item 5c): past
``--max-models`` a training model or a base model to sample is a 400 saying how to free one;
past ``--max-sessions`` a session is a 400 unless one has been silent for ``SESSION_TIMEOUT_S``,
which is then dropped with its models; a cap below 1 is one line at start."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_run_files import within

from creditrl.cli import main
from creditrl.models.tiny import tiny_model_dir
from creditrl.tinker.server import TinkerServer
from creditrl.tinker.service import SESSION_TIMEOUT_S, Settings

httpx = pytest.importorskip("httpx", reason="httpx comes with the tinker SDK")


def _post(server: TinkerServer, path: str, **body) -> httpx.Response:
    return httpx.post(f"{server.base_url}/api/v1/{path}", json=body, timeout=60)


def _session(server: TinkerServer) -> str:
    answer = _post(server, "create_session")
    assert answer.status_code == 200, answer.text
    return answer.json()["session_id"]


def _create_model(server: TinkerServer, sid: str, seq: int = 0) -> httpx.Response:
    return _post(
        server,
        "create_model",
        session_id=sid,
        base_model=str(tiny_model_dir()),
        lora_config={"rank": 2},
        model_seq_id=seq,
    )


def _model(server: TinkerServer, sid: str, seq: int = 0) -> str:
    """A training model made in session ``sid`` (the future polled as the SDK does)."""
    answer = _create_model(server, sid, seq)
    assert answer.status_code == 200, answer.text
    while True:
        got = _post(server, "retrieve_future", request_id=answer.json()["request_id"])
        if got.status_code != 408:
            assert "model_id" in got.json(), got.text
            return got.json()["model_id"]


def _refused(answer: httpx.Response, said: str) -> None:
    assert answer.status_code == 400, answer.text
    assert said in answer.json()["detail"]


@pytest.fixture
def server(tmp_path: Path):
    srv = TinkerServer(Settings(out_dir=tmp_path, max_sessions=2, max_models=1))
    srv.start()
    yield srv
    srv.close()


def test_models_past_max_models_are_refused_until_a_session_frees_one(server) -> None:
    first = _session(server)
    _model(server, first)
    more = "this service holds at most 1 models; close a session or restart it with a larger "
    _refused(_create_model(server, first, 1), more + "--max-models")
    sampler = {"session_id": first, "base_model": str(tiny_model_dir())}
    _refused(_post(server, "create_sampling_session", **sampler), "holds at most 1 models")
    assert set(server.service.policies) == {f"{first}:train:0"} and not server.service.reserved
    assert _post(server, f"sessions/{first}/finish").status_code == 200
    second = _session(server)
    assert _model(server, second) == f"{second}:train:0"  # the finished session's room
    assert httpx.get(f"{server.base_url}/api/v1/healthz").json() == {"status": "ok"}


def test_sessions_past_max_sessions_are_refused_unless_one_went_silent(server) -> None:
    """A session silent for SESSION_TIMEOUT_S is dropped, with its models, when room is
    needed; a live one never is."""
    quiet, live = _session(server), _session(server)
    _model(server, quiet)
    _refused(
        _post(server, "create_session"),
        "this service holds at most 2 sessions; close one (ServiceClient.close()) or restart "
        "it with a larger --max-sessions",
    )
    server.service.sessions[quiet].seen -= SESSION_TIMEOUT_S + 1
    newer = _session(server)
    assert set(server.service.sessions) == {live, newer} and not server.service.policies
    gone = _post(server, "session_heartbeat", session_id=quiet)
    assert gone.status_code == 410 and "no session" in gone.json()["detail"]
    _refused(_post(server, "create_session"), "at most 2 sessions")  # both are live
    assert _model(server, newer) == f"{newer}:train:0"  # the dropped session's model's room


@pytest.mark.parametrize("flag", ["--max-sessions", "--max-models"])
def test_caps_below_one_are_one_line_at_start(tmp_path: Path, capsys, flag: str) -> None:
    """--max-sessions 0 started a service that refused every session (and -1 every model)."""
    argv = ["serve-tinker", "--port", "0", "--out", str(tmp_path), flag, "0"]
    assert within(60, main, argv) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"error: {flag} 0: must be at least 1"], out
