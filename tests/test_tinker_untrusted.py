"""``creditrl serve-tinker`` as an attacker would use it (issue 50, round 5): checkpoint paths
and names that lead out of the service's folder, model names for any directory, malformed and
oversized bodies, slow and idle clients, floods and numbers that would break the model. Each
is a 4xx with a message, a dropped connection or a bounded wait, counted, and the service
goes on (docs/security.md, "Round 5 probes")."""

from __future__ import annotations

import os
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from creditrl.models.tiny import tiny_model_dir
from creditrl.tinker.messages import BadRequest, Limits, parse_forward_backward
from creditrl.tinker.server import CLIENT_CONFIG, TinkerServer
from creditrl.tinker.service import Settings
from creditrl.tinker.wire import _encode_varint, bytes_field, varint_field

tinker = pytest.importorskip("tinker", reason="the tinker SDK is the extra creditrl[tinker]")
httpx = pytest.importorskip("httpx", reason="httpx comes with the tinker SDK")
types = tinker.types
PROTO = {"Content-Type": "application/x-protobuf"}


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = TinkerServer(Settings(out_dir=tmp_path_factory.mktemp("tinker"), max_sessions=4))
    srv.start()
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def trainer(server: TinkerServer, monkeypatch_module):
    monkeypatch_module.setenv("TINKER_BASE_URL", server.base_url)
    monkeypatch_module.setenv("TINKER_API_KEY", "tml-local")
    client = tinker.ServiceClient()
    yield client.create_lora_training_client(base_model=str(tiny_model_dir()), rank=2).result()
    client.close("success")


def _post(server: TinkerServer, path: str, **kwargs) -> httpx.Response:
    return httpx.post(f"{server.base_url}/api/v1/{path}", timeout=30, **kwargs)


def _get(server: TinkerServer, path: str) -> httpx.Response:
    return httpx.get(f"{server.base_url}/api/v1/{path}", timeout=30)


def _result(server: TinkerServer, answer: httpx.Response) -> dict:
    """The result of the future a request returned (polling as the SDK does)."""
    assert answer.status_code == 200, answer.text
    while True:
        got = _post(server, "retrieve_future", json={"request_id": answer.json()["request_id"]})
        if got.status_code != 408:
            return got.json()


def _raw(port: int, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(data)
    return sock


def _closed(sock: socket.socket) -> bool:
    sock.settimeout(0.05)
    try:
        return sock.recv(65536) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


# ---- forward_backward bodies ----------------------------------------------------------------


def _tensor(shape: list[int], values: np.ndarray | None = None, csr=None) -> bytes:
    """A Tensor message: float32, ``shape``, dense ``values`` or CSR (values, crow, cols)."""
    body = varint_field(3, 1) + bytes_field(4, b"".join(_encode_varint(s) for s in shape))
    if csr is not None:
        vals, crow, cols = csr
        body += bytes_field(
            2,
            bytes_field(1, np.asarray(vals, "<f4").tobytes())
            + bytes_field(2, np.asarray(crow, "<i8").tobytes())
            + bytes_field(3, np.asarray(cols, "<i8").tobytes()),
        )
    else:
        body += bytes_field(1, np.asarray(values, "<f4").tobytes())
    return body


def _request(tokens: int, inputs: dict[str, bytes], datums: int = 1) -> bytes:
    chunk = bytes_field(1, bytes_field(1, np.arange(tokens, dtype="<i4").tobytes()))
    datum = bytes_field(1, chunk) + b"".join(
        bytes_field(2, bytes_field(1, name) + bytes_field(2, t)) for name, t in inputs.items()
    )
    head = bytes_field(1, "m") + bytes_field(4, "cross_entropy")
    return head + b"".join(bytes_field(3, datum) for _ in range(datums))


@pytest.mark.parametrize(
    ("csr", "words"),
    [
        (([1.0], [1, 0], [0]), "row pointers"),  # decreasing: to_dense crashed the process
        (([1.0], [0, 5], [0]), "row pointers"),  # past the value count: read out of bounds
        (([1.0], [0, 1], [10]), "column index outside"),  # an IndexError traceback, a 500
        (([1.0], [0, 1], [-3]), "column index outside"),
    ],
)
def test_forged_sparse_tensors_are_refused_before_they_are_built(csr, words) -> None:
    body = _request(10, {"weights": _tensor([1, 10], csr=csr)})
    with pytest.raises(BadRequest, match=words):
        parse_forward_backward(body, Limits())


def test_a_sparse_tensor_fills_in_its_values() -> None:
    body = _request(6, {"weights": _tensor([2, 3], csr=([2.0, 5.0], [0, 1, 2], [2, 0]))})
    (datum,) = parse_forward_backward(body, Limits()).data
    assert datum.inputs["weights"].tolist() == [0.0, 0.0, 2.0, 5.0, 0.0, 0.0]


def test_inputs_cannot_amplify_a_small_body() -> None:
    """2000 empty sparse inputs of 8192 values each (100 KB of body) held 64 MB and took
    0.6 s before; a datum takes at most Limits.max_inputs inputs, and a tensor whose size is
    not its datum's length is refused before it is built."""
    empty = _tensor([1, 8192], csr=([], [0, 0], []))
    many = _request(8192, {f"x{i}": empty for i in range(2000)})
    with pytest.raises(BadRequest, match="at most 16"):
        parse_forward_backward(many, Limits())
    huge = _tensor([1 << 20, 1 << 20], csr=([], [0] * 2, []))
    with pytest.raises(BadRequest, match="values, not 10"):
        parse_forward_backward(_request(10, {"weights": huge}), Limits())
    limits = Limits(max_total_tokens=100)
    with pytest.raises(BadRequest, match="more than 100 tokens"):
        parse_forward_backward(_request(60, {}, datums=500), limits)


# ---- checkpoint names and paths, model names --------------------------------------------------


def test_checkpoint_paths_stay_in_the_service_folder(
    server: TinkerServer, trainer, tmp_path: Path
) -> None:
    """A run id or name with '..', '/', an absolute path; a run folder, checkpoint folder or
    file that is a symbolic link or a FIFO: refused (4xx), never followed; listing '..' lists
    nothing outside (before: it listed ROOT/../weights/*)."""
    root = server.settings.out_dir / "checkpoints"
    for name in ["../x", "/abs", "a/../../b", "..", ".hidden", "x\x00"]:
        answer = _post(server, "save_weights", json={"model_id": trainer.model_id, "path": name})
        assert answer.status_code == 400, (name, answer.text)
    state = trainer.save_state("mine").result().path
    for path in ["tinker://../weights/x", "tinker:///etc/weights/x", "/etc/passwd"]:
        answer = _post(server, "load_weights", json={"model_id": trainer.model_id, "path": path})
        assert answer.status_code == 400, (path, answer.text)

    outside = tmp_path / "elsewhere"
    (outside / "weights" / "stolen").mkdir(parents=True)
    (outside / "weights" / "stolen" / "meta.json").write_text('{"lora": {}}')
    (root / "linked").symlink_to(outside)  # a run folder that is a link
    assert _get(server, "training_runs/%2e%2e/checkpoints").status_code == 404
    assert _get(server, "training_runs/linked/checkpoints").status_code == 404
    listed = _get(server, "checkpoints").json()["checkpoints"]
    assert [c["tinker_path"] for c in listed] == [state]
    load = {"model_id": trainer.model_id, "path": "tinker://linked/weights/stolen"}
    assert "symbolic link" in _result(server, _post(server, "load_weights", json=load))["error"]

    folder = root / trainer.model_id / "weights" / "mine"
    fifo = folder / "adapter.model.safetensors"
    real = folder / "real.safetensors"
    fifo.rename(real)
    os.mkfifo(fifo)  # opened by the worker, it would block the service for good
    load = {"model_id": trainer.model_id, "path": state}
    assert (
        "not a regular file" in _result(server, _post(server, "load_weights", json=load))["error"]
    )
    fifo.unlink()
    fifo.symlink_to(real)
    assert (
        "not a regular file" in _result(server, _post(server, "load_weights", json=load))["error"]
    )
    fifo.unlink()
    real.rename(fifo)
    assert _result(server, _post(server, "load_weights", json=load))["type"] == "load_weights"


def test_model_names_are_strings_naming_model_directories(server: TinkerServer, trainer) -> None:
    """base_model that is no string (a list was a TypeError traceback and a 500 in
    load_weights) or names a directory that is no model is a 400 naming it; a directory that
    passed is not checked again on the event loop for each request of a flood."""
    session = _post(server, "create_session", json={}).json()["session_id"]
    state = trainer.save_state("named").result().path
    for base in [5, ["x"], {"a": 1}]:
        body = {"session_id": session, "path": state, "model_seq_id": 9, "base_model": base}
        answer = _post(server, "load_weights", json=body)
        assert answer.status_code == 400 and "base_model" in answer.json()["detail"], answer.text
    for base in ["/", "/etc", "/dev/zero", "../../etc", "\x00"]:
        body = {"session_id": session, "base_model": base, "model_seq_id": 0, "lora_config": {}}
        answer = _post(server, "create_model", json=body)
        assert answer.status_code == 400 and "base model" in answer.json()["detail"], answer.text
    directory = str(tiny_model_dir())
    assert server.service.checked[directory] == directory
    assert _post(server, f"sessions/{session}/finish", json={}).status_code == 200


# ---- numbers that would break the model ---------------------------------------------------------


def _datum(tokens: list[int], **inputs) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], **inputs},
    )


def test_optim_step_never_leaves_or_answers_non_finite_numbers(
    server: TinkerServer, trainer
) -> None:
    """weights of 3e38 (finite) made the gradient infinite: the step was skipped but answered
    grad_norm Infinity, which the SDK failed to read (JSONDecodeError); a learning_rate of
    1e400 (inf in JSON) made every adapter NaN. Now: a RequestFailedError saying the step was
    skipped, a 400 for the number, and the adapters as they were."""
    tokens = list(range(5, 15))
    policy = server.service.policies[trainer.model_id]
    before = policy.adapter_state()
    trainer.forward_backward([_datum(tokens, weights=[3e38] * 9)], "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError, match="step was skipped"):
        trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    after = policy.adapter_state()
    assert all(torch.equal(before[k], after[k]) for k in before)
    trainer.forward_backward([_datum(tokens, weights=[1.0] * 9)], "cross_entropy").result()
    body = (
        b'{"model_id": "%s", "adam_params": {"learning_rate": 1e400}}' % trainer.model_id.encode()
    )
    answer = _post(server, "optim_step", content=body)
    assert answer.status_code == 400 and "finite" in answer.json()["detail"]
    trainer.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    assert all(bool(torch.isfinite(v).all()) for v in policy.adapter_state().values())


# ---- slow clients and floods ------------------------------------------------------------------


def test_slow_and_idle_connections_are_bounded(tmp_path: Path) -> None:
    """12 connections trickling half a request head, past max_connections=4: the oldest are
    dropped for new ones (counted), every one is closed after idle_timeout_s, and a request
    still gets through; a body sent byte by byte that does not arrive in time is a 408
    (before: held for ever, and 2000 half-open connections were 2000 open descriptors)."""
    srv = TinkerServer(Settings(out_dir=tmp_path), max_connections=4, idle_timeout_s=2.0)
    srv.start()
    try:
        head = b"POST /api/v1/create_session HTTP/1.1\r\nHost: a\r\n"
        half = []
        for _ in range(12):  # one by one: a burst accepted at once passes until the next accept
            half.append(_raw(srv.port, head))
            time.sleep(0.05)
        for _ in range(200):
            if srv.refused["connection_dropped"] >= 8:
                break
            threading.Event().wait(0.05)
        assert srv.refused["connection_dropped"] >= 8
        assert _get(srv, "healthz").json() == {"status": "ok"}
        slow = _raw(
            srv.port,
            b"POST /api/v1/create_session HTTP/1.1\r\nHost: a\r\nContent-Length: 100\r\n\r\n{",
        )
        for byte in b'"a"':  # a byte every 0.5 s: the body as a whole is late
            slow.sendall(bytes([byte]))
            time.sleep(0.5)
        slow.settimeout(30)
        assert slow.recv(65536).startswith(b"HTTP/1.1 408")
        for _ in range(200):
            if all(_closed(c) for c in half):
                break
            threading.Event().wait(0.05)
        assert all(_closed(c) for c in half)
        assert srv.refused["http_408"] == 1
    finally:
        srv.close()


def test_floods_are_bounded_and_answered(tmp_path: Path) -> None:
    """Sessions, queued requests and kept results have caps (their own test at last): past
    max_sessions a 400 saying how to free one, past max_pending a 429 the SDK retries, and at
    most max_kept finished results are held. The SDK is told to keep at most
    SAMPLE_CONCURRENCY sampling requests in flight, within the connection limit."""
    srv = TinkerServer(Settings(out_dir=tmp_path, max_sessions=2, max_pending=2, max_kept=3))
    srv.start()
    try:
        assert (
            _post(srv, "client/config", json={}).json()["sample_max_concurrent_requests"]
            == (CLIENT_CONFIG["sample_max_concurrent_requests"])
        )
        assert CLIENT_CONFIG["sample_max_concurrent_requests"] < srv.max_connections
        answers = [_post(srv, "create_session", json={}) for _ in range(5)]
        assert [a.status_code for a in answers] == [200, 200, 400, 400, 400]
        assert "at most 2 sessions" in answers[2].json()["detail"]
        gate = threading.Event()
        futures = srv.service.futures
        queued = [futures.submit(gate.wait) for _ in range(2)]
        with pytest.raises(BadRequest) as err:
            futures.submit(gate.wait)
        assert err.value.status == 429
        gate.set()
        for _ in range(200):
            if not futures.pending:
                break
            time.sleep(0.05)
        done = []
        for _ in range(6):
            done.append(futures.submit(lambda: {"ok": True}))
            for _ in range(200):
                if done[-1] in futures.done:
                    break
                time.sleep(0.05)
        assert len(futures.done) == 3 and set(futures.done) == set(done[-3:])
        assert not futures.pending and not set(queued) & set(futures.done)
        assert _get(srv, "healthz").json() == {"status": "ok"}
    finally:
        srv.close()
