"""The Tinker service's state and operations, without HTTP: sessions, training models,
samplers, checkpoints and futures. Each operation takes a checked JSON body (a dict) or a
decoded message and returns a JSON-able dict, or submits a job to the ``FutureTable`` and
returns Tinker's ``UntypedAPIFuture``; the jobs call ``Policy`` (creditrl's workers, losses and
engine), ``CheckpointStore`` (creditrl's checkpoint I/O) and ``StabilityRecords`` (the samples
recorded with ``record_stability_info``, which ``stable_reinforce`` datums name), nothing else.

Bounded: ``max_sessions`` sessions (one silent for ``SESSION_TIMEOUT_S`` is dropped, with its
models, when room is needed), ``max_models`` models loaded at once, ``max_samplers`` samplers,
sampling at most ``max_num_samples`` samples of at most ``max_sample_tokens`` tokens, at most
``max_recorded_tokens`` recorded prompt and sampled tokens.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from creditrl.models import resolve_model_path
from creditrl.models.embedded import EMBEDDED_NAME
from creditrl.tinker.checkpoints import CheckpointRef, CheckpointStore
from creditrl.tinker.futures import Failure, FutureTable, ProtoResult, outcome
from creditrl.tinker.losses import LOSSES
from creditrl.tinker.messages import (
    BadRequest,
    ForwardBackwardRequest,
    Limits,
    encode_forward_backward_output,
    encode_sample_response,
    model_input_tokens,
)
from creditrl.tinker.policy import AdamStep, LoraSpec, Policy, SampleParams
from creditrl.tinker.records import RunRecord
from creditrl.tinker.stability import StabilityRecords

__all__ = ["EMBEDDED_ALIASES", "Service", "Settings"]

EMBEDDED_ALIASES = ("embedded", EMBEDDED_NAME, f"HuggingFaceTB/{EMBEDDED_NAME}")
SESSION_TIMEOUT_S = 600.0
SAMPLE_GROUP = 32  # sampling requests answered by one engine call at most
# a drain first waits until no sampling request has arrived for GATHER_QUIET_S (at most
# GATHER_MAX_S): a client's concurrent requests arrive one HTTP request at a time, and the
# first would otherwise be sampled alone, the rest in a second engine call
GATHER_QUIET_S = 0.02
GATHER_MAX_S = 0.2
MAX_CHECKED = 64  # base model names whose directory check is remembered


@dataclass(frozen=True)
class Settings:
    """The service's folder, bounds and extra named models (name -> local directory)."""

    out_dir: Path
    models: dict[str, str] = field(default_factory=dict)
    max_sessions: int = 8
    max_models: int = 4
    max_samplers: int = 8
    max_pending: int = 256
    max_kept: int = 256
    max_num_samples: int = 64
    max_sample_tokens: int = 2048
    max_recorded_tokens: int = 4_000_000  # stable_reinforce's records, prompts + samples
    limits: Limits = field(default_factory=Limits)


@dataclass
class Session:
    id: str
    seen: float
    models: set[str] = field(default_factory=set)
    samplers: set[str] = field(default_factory=set)


@dataclass
class SampleWanted:
    """A queued sampling request."""

    request_id: str
    sampler: Sampler
    prompt: list[int]
    num: int
    seed: int | None
    params: SampleParams
    with_prompt: bool
    last_n: int | None
    ids: tuple[str, ...] = ()  # the sequence ids the client was given
    record: bool = False  # record_stability_info: keep the samples for stable_reinforce


@dataclass
class Sampler:
    """Samples from ``model_id``'s module holding ``adapters`` (None: as it is)."""

    id: str
    model_id: str
    base_model: str
    model_path: str | None
    adapters: dict[str, torch.Tensor] | None
    version: int | None = None


def _number(body: dict, key: str, default: float, kind: type = float) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if kind is int and type(value) is not int:
        raise BadRequest(f"{key} must be an integer")
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise BadRequest(f"{key} must be a number")
    if not math.isfinite(value):  # JSON's 1e400 decodes to inf
        raise BadRequest(f"{key} must be a finite number")
    return kind(value)


def _check_step(
    policy: Policy, before: dict[str, torch.Tensor], metrics: dict[str, float], step: AdamStep
) -> None:
    """BadRequest when an optim_step did not leave finite weights: a gradient whose norm is
    not finite was dropped unapplied; a step that made a weight non-finite (a huge
    ``learning_rate``) is undone (the adapters are restored). Either way the answer holds no
    NaN or Infinity, which the SDK cannot read as JSON."""
    norm = metrics.get("grad_norm:mean", 0.0)
    if not math.isfinite(norm):
        raise BadRequest(
            f"the accumulated gradient's norm is {norm}: the step was skipped and the "
            "gradient dropped (check the loss_fn_inputs of the forward_backward calls)"
        )
    after = policy.adapter_state()
    if not all(bool(torch.isfinite(v).all()) for v in after.values()):
        policy.load_adapter(before)
        raise BadRequest(
            f"the step with learning_rate={step.learning_rate:g} made weights non-finite; "
            "they were restored as before the step"
        )


def _string(body: dict, key: str, required: bool = True) -> str | None:
    value = body.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value or len(value) > 4096:
        raise BadRequest(f"{key} must be a non-empty string")
    return value


class Service:
    """All the state of one ``creditrl serve-tinker``."""

    def __init__(self, settings: Settings, loop: asyncio.AbstractEventLoop) -> None:
        self.settings = settings
        self.futures = FutureTable(loop, settings.max_pending, settings.max_kept)
        self.store = CheckpointStore(settings.out_dir / "checkpoints")
        self.sessions: dict[str, Session] = {}
        self.policies: dict[str, Policy] = {}
        self.records: dict[str, RunRecord] = {}
        self.samplers: dict[str, Sampler] = {}
        self.reserved: set[str] = set()  # models being loaded
        self.lock = threading.Lock()
        self.waiting: list[SampleWanted] = []  # sampling requests not yet taken by the worker
        self.draining = False
        self.stability = StabilityRecords(settings.max_recorded_tokens)
        self.checked: dict[str, str] = {}  # base model directories that passed their checks

    # ---- models and sessions ---------------------------------------------------------------

    def base_directory(self, name: str) -> str:
        """The local directory of base model ``name``: the embedded model's names, a name
        given with ``--model NAME=DIR``, or a local model directory."""
        if not isinstance(name, str):
            raise BadRequest("base_model must be a non-empty string")
        if name in self.checked:  # a flood of requests naming one model checks it once
            return self.checked[name]
        if name in EMBEDDED_ALIASES:
            path = "embedded"
        elif name in self.settings.models:
            path = self.settings.models[name]
        elif Path(name).is_absolute():
            path = name
        else:
            path = None
        if path is not None:
            try:
                directory = str(resolve_model_path(path))
            except (OSError, ValueError) as err:
                raise BadRequest(f"base model {name!r}: {err}") from None
            if len(self.checked) >= MAX_CHECKED:
                self.checked.clear()
            self.checked[name] = directory
            return directory
        known = ", ".join([*EMBEDDED_ALIASES, *self.settings.models])
        raise BadRequest(
            f"base model {name!r} is not served here; use one of {known}, or the absolute "
            "path of a local model directory (nothing is downloaded)"
        )

    def capabilities(self) -> dict:
        names = [EMBEDDED_ALIASES[2], *self.settings.models]
        return {
            "supported_models": [
                {"model_name": n, "trainable": True, "sampleable": True} for n in names
            ]
        }

    def create_session(self, body: dict) -> dict:
        now = time.time()
        for sid, session in list(self.sessions.items()):
            if len(self.sessions) >= self.settings.max_sessions and (
                now - session.seen > SESSION_TIMEOUT_S
            ):
                self.finish_session(sid)
        if len(self.sessions) >= self.settings.max_sessions:
            raise BadRequest(
                f"this service holds at most {self.settings.max_sessions} sessions; close one "
                "(ServiceClient.close()) or restart it with a larger --max-sessions"
            )
        sid = uuid.uuid4().hex[:16]
        self.sessions[sid] = Session(sid, now)
        return {"type": "create_session", "session_id": sid}

    def session(self, sid: Any) -> Session:
        session = self.sessions.get(sid) if isinstance(sid, str) else None
        if session is None:
            raise BadRequest(f"no session {sid!r} on this service (finished?)", status=410)
        session.seen = time.time()
        return session

    def finish_session(self, sid: str) -> None:
        session = self.sessions.pop(sid, None)
        if session is None:
            return
        for model_id in session.models:
            self.policies.pop(model_id, None)
            record = self.records.pop(model_id, None)
            if record is not None:
                record.close()
        for sampler_id in session.samplers:
            self.samplers.pop(sampler_id, None)
        self.stability.drop_session(sid)

    def policy(self, model_id: Any) -> Policy:
        policy = self.policies.get(model_id) if isinstance(model_id, str) else None
        if policy is None:
            raise BadRequest(f"no model {model_id!r} on this service", status=404)
        return policy

    def trainee(self, model_id: Any) -> tuple[Policy, RunRecord]:
        """A training model (one made by create_model or load_weights) and its record."""
        record = self.records.get(model_id) if isinstance(model_id, str) else None
        if record is None:
            raise BadRequest(f"no training model {model_id!r} on this service", status=404)
        return self.policies[model_id], record

    def _reserve_model(self, session: Session, seq: Any) -> str:
        if type(seq) is not int or seq < 0:
            raise BadRequest("model_seq_id must be a non-negative integer")
        if len(self.policies) + len(self.reserved) >= self.settings.max_models:
            raise BadRequest(
                f"this service holds at most {self.settings.max_models} models; close a "
                "session or restart it with a larger --max-models"
            )
        model_id = f"{session.id}:train:{seq}"
        if model_id in self.policies:
            raise BadRequest(f"model {model_id} already exists")
        self.reserved.add(model_id)
        return model_id

    def _install(self, session: Session, model_id: str, policy: Policy) -> None:
        self.policies[model_id] = policy
        session.models.add(model_id)
        folder = self.settings.out_dir / "runs" / model_id.replace(":", "-")
        self.records[model_id] = RunRecord(folder, policy.tokenizer, policy.pad_id)

    def create_model(self, body: dict) -> dict:
        session = self.session(body.get("session_id"))
        base = _string(body, "base_model")
        lora_body = body.get("lora_config")
        if not isinstance(lora_body, dict):
            raise BadRequest("only LoRA training is supported: give a lora_config")
        rank = _number(lora_body, "rank", 32, int)
        if not 1 <= rank <= 512:
            raise BadRequest("LoRA rank must be in [1, 512]")
        optimizer = body.get("optimizer_config") or {"type": "adamw"}
        if not isinstance(optimizer, dict) or optimizer.get("type", "adamw") != "adamw":
            raise BadRequest("only the Adam optimizer is supported (optimizer type 'adamw')")
        seed = lora_body.get("seed")
        spec = LoraSpec(
            rank=rank,
            seed=seed if type(seed) is int else None,
            train_mlp=bool(lora_body.get("train_mlp", True)),
            train_attn=bool(lora_body.get("train_attn", True)),
            train_unembed=bool(lora_body.get("train_unembed", True)),
        )
        directory = self.base_directory(base)
        model_id = self._reserve_model(session, body.get("model_seq_id"))

        def job() -> dict:
            try:
                policy = Policy(base, directory, spec)
            finally:
                self.reserved.discard(model_id)
            self._install(session, model_id, policy)
            return {"type": "create_model", "model_id": model_id}

        return self._future(job, model_id)

    def get_info(self, body: dict) -> dict:
        model_id = body.get("model_id")
        policy = self.policy(model_id)
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {
                "arch": type(policy.module.get_base_model()).__name__,
                "model_name": policy.base_model,
                "tokenizer_id": policy.directory,
            },
            "is_lora": policy.lora is not None,
            "lora_rank": policy.lora.rank if policy.lora else None,
            "model_name": policy.base_model,
        }

    def _future(self, job, model_id: str | None = None, extra: dict | None = None) -> dict:
        request_id = self.futures.submit(job)
        return {"request_id": request_id, "model_id": model_id, **(extra or {})}

    # ---- training ----------------------------------------------------------------------------

    def forward_backward(self, request: ForwardBackwardRequest) -> dict:
        policy, record = self.trainee(request.model_id)

        spec = LOSSES.get(request.loss_fn)
        session_id = request.model_id.split(":", 1)[0]

        def job() -> ProtoResult:
            start = time.perf_counter()
            if spec is not None and spec.provenance:  # stable_reinforce: the recorded samples
                self.stability.attach(session_id, request.data)
            logprobs, metrics = policy.forward_backward(
                request.data, request.loss_fn, request.config, request.forward_only
            )
            record.timed("forward_backward", time.perf_counter() - start)
            if not request.forward_only:
                record.trained(request.data, request.loss_fn, metrics)
            body = encode_forward_backward_output({"logprobs": logprobs}, metrics, len(logprobs))
            return ProtoResult(body)

        return self._future(job, request.model_id)

    def optim_step(self, body: dict) -> dict:
        model_id = body.get("model_id")
        policy, record = self.trainee(model_id)
        params = body.get("adam_params")
        if not isinstance(params, dict):
            raise BadRequest("optim_step takes adam_params only (the Adam optimizer)")
        step = AdamStep(
            learning_rate=_number(params, "learning_rate", 1e-4),
            beta1=_number(params, "beta1", 0.9),
            beta2=_number(params, "beta2", 0.95),
            eps=_number(params, "eps", 1e-12),
            weight_decay=_number(params, "weight_decay", 0.0),
            grad_clip_norm=_number(params, "grad_clip_norm", 0.0),
        )

        def job() -> dict:
            start = time.perf_counter()
            before = policy.adapter_state()
            metrics = policy.optim_step(step)
            record.timed("optim_step", time.perf_counter() - start)
            _check_step(policy, before, metrics, step)
            record.stepped(metrics)
            return {"type": "optim_step", "metrics": metrics}

        return self._future(job, model_id)

    # ---- weights -------------------------------------------------------------------------------

    def _ref(self, model_id: str, kind: str, name: Any) -> CheckpointRef:
        if not isinstance(name, str):
            raise BadRequest("a checkpoint name must be a string")
        return CheckpointRef.parse(f"tinker://{model_id}/{kind}/{name}")

    def save_weights(self, body: dict) -> dict:
        model_id = body.get("model_id")
        policy, _ = self.trainee(model_id)
        ref = self._ref(model_id, "weights", body.get("path"))
        overwrite = bool(body.get("overwrite", False))

        def job() -> dict:
            return {"type": "save_weights", "path": self.store.save(policy, ref, overwrite)}

        return self._future(job, model_id)

    def save_weights_for_sampler(self, body: dict) -> dict:
        model_id = body.get("model_id")
        policy, _ = self.trainee(model_id)
        session = self.session(model_id.split(":", 1)[0])
        if body.get("path") is not None:
            ref = self._ref(model_id, "sampler_weights", body.get("path"))

            def save() -> dict:
                return {"type": "save_weights_for_sampler", "path": self.store.save(policy, ref)}

            return self._future(save, model_id)
        self._check_sampler_room()

        def snapshot() -> dict:
            sampler_id = self._add_sampler(session, model_id, policy.base_model, None)
            sampler = self.samplers[sampler_id]
            # a sampler of this weight version shares the version's snapshot (never written
            # to): an unchanged model is neither copied again nor merged again to sample
            same = next(
                (
                    s.adapters
                    for s in self.samplers.values()
                    if s.model_id == model_id
                    and s.model_path is None
                    and s.version == policy.version
                    and s.adapters is not None
                ),
                None,
            )
            sampler.adapters = same if same is not None else policy.adapter_state()
            sampler.version = policy.version
            return {"type": "save_weights_for_sampler", "sampling_session_id": sampler_id}

        return self._future(snapshot, model_id)

    def load_weights(self, body: dict) -> dict:
        ref = CheckpointRef.parse(_string(body, "path"))
        optimizer = bool(body.get("optimizer", False))
        if body.get("model_id") is not None:
            policy, _ = self.trainee(body.get("model_id"))

            def load_into() -> dict:
                self.store.load(policy, ref, optimizer)
                return {"type": "load_weights", "path": ref.path, "model_id": body["model_id"]}

            return self._future(load_into, body["model_id"])
        session = self.session(body.get("session_id"))
        base, spec = self.store.lora_of(ref)
        base = _string(body, "base_model", required=False) or base
        directory = self.base_directory(base)
        model_id = self._reserve_model(session, body.get("model_seq_id"))

        def create_from() -> dict:
            try:
                policy = Policy(base, directory, spec)
            finally:
                self.reserved.discard(model_id)
            self.store.load(policy, ref, optimizer)
            self._install(session, model_id, policy)
            return {"type": "load_weights", "path": ref.path, "model_id": model_id}

        return self._future(create_from, model_id)

    def list_checkpoints(self, run: str | None) -> dict:
        if run is not None and not self.store.has_run(run) and run not in self.policies:
            raise BadRequest(f"no training run {run!r:.300} on this service", status=404)
        records = self.store.listing(run)
        return {
            "checkpoints": records,
            "cursor": {"offset": 0, "limit": len(records), "total_count": len(records)},
        }

    # ---- sampling ------------------------------------------------------------------------------

    def _check_sampler_room(self) -> None:
        if len(self.samplers) >= self.settings.max_samplers:
            oldest = next(iter(self.samplers))
            for session in self.sessions.values():
                session.samplers.discard(oldest)
            del self.samplers[oldest]

    def _add_sampler(self, session: Session, model_id: str, base: str, path: str | None) -> str:
        self._check_sampler_room()
        sampler_id = f"{session.id}:sample:{uuid.uuid4().hex[:12]}"
        self.samplers[sampler_id] = Sampler(sampler_id, model_id, base, path, None)
        session.samplers.add(sampler_id)
        return sampler_id

    def create_sampling_session(self, body: dict) -> dict:
        session = self.session(body.get("session_id"))
        path = _string(body, "model_path", required=False)
        if path is None:
            base = _string(body, "base_model")
            owner = f"{session.id}:base:{base}"
            if owner not in self.policies:
                directory = self.base_directory(base)
                if len(self.policies) + len(self.reserved) >= self.settings.max_models:
                    raise BadRequest(
                        f"this service holds at most {self.settings.max_models} "
                        "models; close a session"
                    )
                self.policies[owner] = Policy(base, directory, None)
                session.models.add(owner)
            sampler_id = self._add_sampler(session, owner, base, None)
            return {"type": "create_sampling_session", "sampling_session_id": sampler_id}
        ref = CheckpointRef.parse(path)
        owner = ref.run if ref.run in self.policies else None
        if owner is None:
            base, spec = self.store.lora_of(ref)
            owner = f"{session.id}:load:{ref.run}"
            if owner not in self.policies:
                if len(self.policies) + len(self.reserved) >= self.settings.max_models:
                    raise BadRequest(
                        f"this service holds at most {self.settings.max_models} "
                        "models; close a session"
                    )
                self.policies[owner] = Policy(base, self.base_directory(base), spec)
                session.models.add(owner)
        policy = self.policies[owner]
        sampler_id = self._add_sampler(session, owner, policy.base_model, path)
        snapshot = policy.adapter_state()
        self.store.load(policy, ref, optimizer=False)
        self.samplers[sampler_id].adapters = policy.adapter_state()
        policy.load_adapter(snapshot)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    def get_sampler(self, sampler_id: str) -> dict:
        sampler = self.samplers.get(sampler_id)
        if sampler is None:
            raise BadRequest(f"no sampler {sampler_id!r} on this service", status=404)
        return {
            "sampler_id": sampler.id,
            "base_model": sampler.base_model,
            "model_path": sampler.model_path,
        }

    def _sample_params(self, body: dict, policy: Policy) -> SampleParams:
        params = body.get("sampling_params")
        if not isinstance(params, dict):
            raise BadRequest("sampling_params must be an object")
        max_tokens = _number(params, "max_tokens", 256, int)
        if not 1 <= max_tokens <= self.settings.max_sample_tokens:
            raise BadRequest(f"max_tokens must be in [1, {self.settings.max_sample_tokens}]")
        temperature = _number(params, "temperature", 1.0)
        top_p = _number(params, "top_p", 1.0)
        if temperature < 0 or not 0 < top_p <= 1:
            raise BadRequest("temperature must be >= 0 and top_p in (0, 1]")
        stop = params.get("stop")
        stop_ids: tuple[int, ...] = policy.eos_ids
        strings: tuple[str, ...] = ()
        if isinstance(stop, str):
            stop = [stop]
        if isinstance(stop, list):
            if len(stop) > 16:
                raise BadRequest("at most 16 stop sequences")
            if all(type(s) is int for s in stop):
                stop_ids = tuple(stop)
            elif all(isinstance(s, str) and 0 < len(s) <= 256 for s in stop):
                strings = tuple(stop)
                single = [policy.tokenizer.encode(s, add_special_tokens=False) for s in strings]
                stop_ids = (*policy.eos_ids, *(ids[0] for ids in single if len(ids) == 1))
            else:
                raise BadRequest("stop must be a string, a list of strings or of token ids")
        elif stop is not None:
            raise BadRequest("stop must be a string, a list of strings or of token ids")
        return SampleParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_k=_number(params, "top_k", -1, int),
            top_p=top_p,
            stop_ids=stop_ids,
            stop_strings=strings,
        )

    def sample(self, body: dict) -> dict:
        sampler = self.samplers.get(body.get("sampling_session_id"))
        if sampler is None:
            raise BadRequest("no such sampling session on this service", status=404)
        policy = self.policy(sampler.model_id)
        limits = self.settings.limits
        prompt = model_input_tokens(body.get("prompt"), limits)
        if not prompt:
            raise BadRequest("the prompt is empty")
        num = _number(body, "num_samples", 1, int)
        if not 1 <= num <= self.settings.max_num_samples:
            raise BadRequest(f"num_samples must be in [1, {self.settings.max_num_samples}]")
        params = self._sample_params(body, policy)
        for key in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k"):
            if body.get(key):
                raise BadRequest(f"{key} is not supported by this local service")
        if body.get("target_prompt_logprobs"):
            raise BadRequest("target_prompt_logprobs is not supported by this local service")
        with_prompt = bool(body.get("prompt_logprobs"))
        last_n = body.get("prompt_logprobs_last_n")
        if last_n is not None and (type(last_n) is not int or not 1 <= last_n < len(prompt)):
            raise BadRequest("prompt_logprobs_last_n must be in [1, len(prompt) - 1]")
        seed = body.get("sampling_params", {}).get("seed")
        if seed is not None and (type(seed) is not int or not 0 <= seed < 1 << 62):
            raise BadRequest("seed must be an integer in [0, 2^62)")
        request_id = self.futures.reserve()
        ids = tuple(f"{sampler.id}:{request_id}:{i}" for i in range(num))
        record = bool(body.get("record_stability_info"))
        wanted = SampleWanted(
            request_id, sampler, prompt, num, seed, params, with_prompt, last_n, ids, record
        )
        with self.lock:
            self.waiting.append(wanted)
            start = not self.draining
            self.draining = True
        if start:
            self.futures.run(self._drain)
        return {
            "request_id": request_id,
            "model_id": None,
            "sample_sequence_ids": list(ids),
        }

    def _drain(self) -> None:
        """On the worker: sample every waiting request, those of one sampler with the same
        settings in one engine call (the recipe's concurrent requests become one batch, once
        they have stopped arriving: ``GATHER_QUIET_S``)."""
        deadline, seen = time.monotonic() + GATHER_MAX_S, -1
        while time.monotonic() < deadline:
            with self.lock:
                count = len(self.waiting)
            if count == seen:
                break
            seen = count
            time.sleep(GATHER_QUIET_S)
        with self.lock:
            waiting, self.waiting, self.draining = self.waiting, [], False
        groups: dict[tuple, list[SampleWanted]] = {}
        for wanted in waiting:
            groups.setdefault((wanted.sampler.id, wanted.params), []).append(wanted)
        for group in groups.values():
            for start in range(0, len(group), SAMPLE_GROUP):
                part = group[start : start + SAMPLE_GROUP]
                results = outcome(lambda part=part: self._sample_group(part))
                for i, wanted in enumerate(part):
                    result = results if isinstance(results, Failure) else results[i]
                    self.futures.resolve(wanted.request_id, result)

    def _sample_group(self, group: list[SampleWanted]) -> list[ProtoResult]:
        sampler, params = group[0].sampler, group[0].params
        policy = self.policy(sampler.model_id)
        record = self.records.get(sampler.model_id)
        start = time.perf_counter()
        with policy.using(sampler.adapters, sampler.version):
            samples = policy.sample([(w.prompt, w.num, w.seed) for w in group], params)
            results = []
            for wanted, sequences in zip(group, samples, strict=True):
                scored = policy.prompt_logprobs(wanted.prompt) if wanted.with_prompt else None
                if scored is not None and wanted.last_n is not None:
                    cut = len(wanted.prompt) - wanted.last_n
                    scored = [float("nan")] * cut + scored[cut:]
                if record is not None:
                    record.sampled([len(s.tokens) for s in sequences])
                if wanted.record:
                    session_id = sampler.id.split(":", 1)[0]
                    self.stability.add(session_id, wanted.ids, wanted.prompt, sequences)
                results.append(ProtoResult(encode_sample_response(sequences, scored)))
        if record is not None:
            record.timed("sample", time.perf_counter() - start)
        return results

    def close(self) -> None:
        self.futures.close()
        for record in self.records.values():
            record.close()
