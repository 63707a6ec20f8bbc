"""Settings shared by the async sampler, learner and launcher: checks and default paths."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from creditrl.asynchronous.validation import max_group_bytes
from creditrl.bounded_json import JsonLimits
from creditrl.config import Config
from creditrl.weights import FolderChannel

__all__ = [
    "check_async_config",
    "inflight_groups",
    "json_limits",
    "max_buffered_bytes",
    "max_message_bytes",
    "needs_reference",
    "run_id",
    "sampler_id_of",
    "start_versions",
    "state_root",
    "teacher_on_sampler",
    "weight_root",
]

_MIB = 1 << 20
_JSON_PER_ANSWER = 64 * 1024  # JSON bytes per answer, besides those per token
_JSON_PER_TOKEN = 64  # JSON bytes per prompt + response token
_JSON_BYTES_PER_ITEM = 32  # one JSON item allowed per this many bytes
_JSON_DEPTH = 64


def sampler_id_of(index: int) -> str:
    """The id of sampler number ``index`` (``s0``, ``s1``, ...)."""
    if index < 0:
        raise ValueError(f"sampler index must be >= 0, got {index}")
    return f"s{index}"


def weight_root(cfg: Config) -> Path:
    """Where the learner publishes weights: ``asynchronous.weight_dir`` or ``<output>/weights``."""
    return Path(cfg.asynchronous.weight_dir or Path(cfg.trainer.output_dir) / "weights")


def run_id(cfg: Config) -> str:
    """The id of a run in the weight folder: its output folder's (resolved) path, hashed, so a
    run resumed or rerun in its own ``trainer.output_dir`` is the same run and another is not."""
    path = str(Path(cfg.trainer.output_dir).resolve())
    return hashlib.sha256(path.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def weight_channel(cfg: Config, publish: bool = False) -> FolderChannel:
    """The weight folder (``weight_root``) as the run's weight channel: learner rank 0 publishes
    there as ``run_id`` (``publish``: it claims the folder, keeps ``keep_weight_versions``, LoRA
    models as ``lora_sync`` says), samplers read it."""
    a = cfg.asynchronous
    return FolderChannel(
        weight_root(cfg),
        publish=publish,
        keep=a.keep_weight_versions,
        lora_sync=a.lora_sync,
        run=run_id(cfg) if publish else None,
    )


def start_versions(
    cfg: Config, channel: FolderChannel, model: Any, version: int, say: Callable[..., Any]
) -> int:
    """Set the weight folder up for a learner at ``version`` (its checkpoint's, 0 for a new
    run) before it answers any sampler; returns the version it trains from. Versions another
    run left there (another ``trainer.output_dir``: ``run_id``) are removed, said in one line
    through ``say``: this run's start clean. This run's own, published before a crash, are
    never reused: it continues past them with ``model`` published as a new version; a resumed
    run whose folder holds neither its version nor a later one publishes its version (so a
    sampler over the wire, whose learner kept nothing across the restart, gets it too).
    Samplers load weights only once the learner has answered them, so they never see what the
    folder held before this."""
    published = channel.newest()
    if published is not None and channel.published_by() != run_id(cfg):
        removed = channel.start_clean()
        say(
            f"learner: {weight_root(cfg)} (asynchronous.weight_dir) held weight versions up to "
            f"v{published} of another run; removed {len(removed)} of them: this run's versions "
            f"start clean at v{version} (a run resumed in its own trainer.output_dir continues "
            "its versions)",
            markup=False,
        )
        published = None
    if published is not None and published >= version:
        version = published + 1
        channel.publish(model, version)
    elif version > 0:  # resumed, and its version is not there (a crash before it was written)
        channel.publish(model, version)
    return version


def state_root(cfg: Config) -> Path:
    """Where samplers keep their outboxes: ``asynchronous.state_dir`` or ``<output>/samplers``."""
    return Path(cfg.asynchronous.state_dir or Path(cfg.trainer.output_dir) / "samplers")


def needs_reference(cfg: Config) -> bool:
    """True when the loss or the reward uses the reference policy's log-probs."""
    return cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward


def teacher_on_sampler(cfg: Config) -> bool:
    """True when samplers compute the distillation teacher's log-probs and send them
    (``distill.teacher`` set, ``distill.teacher_on=sampler``); the learner then has no teacher."""
    return cfg.distill.teacher is not None and cfg.distill.teacher_on == "sampler"


def max_message_bytes(cfg: Config) -> int:
    """The largest message frame the learner's socket accepts (libzmq's ``MAXMSGSIZE``).

    ``asynchronous.max_message_mb`` when > 0; else sized for one group of this run: per answer
    256 bytes per prompt + response token (about 4x the tensors a group holds) plus 64 KiB for
    its text columns, ``rollout.n`` answers, 1 MiB of slack, and never below 8 MiB."""
    mb = cfg.asynchronous.max_message_mb
    if mb > 0:
        return int(mb * _MIB)
    tokens = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    per_answer = 256 * tokens + 64 * 1024
    return max(cfg.rollout.n * per_answer + _MIB, 8 * _MIB)


def json_limits(cfg: Config) -> JsonLimits:
    """Bounds on the JSON of one group's non-tensor columns and meta, checked before it is
    decoded: per answer 64 KiB plus 64 bytes per prompt + response token (the text columns
    carry the prompt and the conversation a few times over, \\u-escaped beyond ASCII), one item
    per 32 of those bytes, nesting 64 deep."""
    tokens = cfg.data.max_prompt_length + cfg.rollout.max_response_length
    nbytes = cfg.rollout.n * (_JSON_PER_ANSWER + _JSON_PER_TOKEN * tokens)
    return JsonLimits(nbytes, _JSON_DEPTH, nbytes // _JSON_BYTES_PER_ITEM)


def inflight_groups(cfg: Config) -> int:
    """The most groups one sampler has unacknowledged: it produces ``sampler_batch_groups``
    (0: ``data.train_batch_size``) at once while fewer than ``max_inflight_groups`` (0: twice
    ``data.train_batch_size``) are unacknowledged."""
    a, batch = cfg.asynchronous, cfg.data.train_batch_size
    return (a.max_inflight_groups or 2 * batch) - 1 + (a.sampler_batch_groups or batch)


def max_buffered_bytes(cfg: Config) -> int:
    """The most bytes of groups the learner buffers: the largest group it accepts
    (``validation.max_group_bytes``) times the groups of two batches, or of every sampler's
    unacknowledged groups when more, so that honest samplers never reach it."""
    samplers = cfg.asynchronous.num_samplers * inflight_groups(cfg)
    groups = max(2 * cfg.data.train_batch_size, samplers)
    largest = max_group_bytes(
        cfg.rollout.n,
        cfg.data.max_prompt_length,
        cfg.rollout.max_response_length,
        json_limits(cfg),
    )
    return groups * largest


def check_async_config(cfg: Config) -> None:
    """ValueError naming the keys for settings the async pair cannot honour (single keys'
    choices and ranges are checked when the config is loaded)."""
    from creditrl.rollout import check_rollout_engine
    from creditrl.workers.plan import Plan

    a = cfg.asynchronous

    check_rollout_engine(cfg.rollout.engine)  # e.g. vllm on a machine without it, named here
    if Plan.from_config(cfg).needs_greedy_baseline:
        raise ValueError(
            f"algorithm.adv_estimator={cfg.algorithm.adv_estimator!r} needs the greedy baseline "
            "of the current policy for each prompt, which a stale sampler cannot give; use "
            "another estimator or `creditrl train`"
        )
    if a.learners > 1 and cfg.trainer.strategy == "fsdp2":
        raise ValueError(
            "trainer.strategy=fsdp2 with asynchronous.learners > 1 is not supported yet (rank 0 "
            "writes checkpoints and weights alone); use trainer.strategy=ddp"
        )
    if cfg.algorithm.filter_groups.enable:
        raise ValueError("algorithm.filter_groups (DAPO dynamic sampling) is not supported async")
    if cfg.data.train_batch_size % a.learners:
        raise ValueError(
            f"data.train_batch_size={cfg.data.train_batch_size} groups must divide evenly over "
            f"asynchronous.learners={a.learners}"
        )
    if a.staleness_policy == "keep" and a.old_log_probs == "sampler":
        raise ValueError(
            "asynchronous.staleness_policy=keep trains late groups corrected by the learner's "
            "per-token importance weights pi_old / pi_behaviour, which "
            "asynchronous.old_log_probs=sampler skips; use old_log_probs=learner"
        )
    if a.max_inflight_groups and a.max_inflight_groups * a.num_samplers < cfg.data.train_batch_size:
        raise ValueError(
            f"asynchronous.max_inflight_groups={a.max_inflight_groups} x num_samplers="
            f"{a.num_samplers} is below the {cfg.data.train_batch_size} groups a learner step "
            "needs (data.train_batch_size): the samplers would wait for acknowledgements forever"
        )
