"""Tinker checkpoints on disk: ``tinker://RUN/weights/NAME`` (adapters and Adam state) and
``tinker://RUN/sampler_weights/NAME`` (adapters only), written by creditrl's checkpoint I/O.

Layout: ``ROOT/RUN/weights/NAME/`` holds ``adapter.model.safetensors`` (and
``adapter.optim.safetensors``), written by ``creditrl.workers.checkpoint_io.save_trainable``
over the adapter parameters only, and ``meta.json`` (base model, LoRA settings, the
checkpoint I/O's meta, time). A checkpoint is written into a temporary directory, fsync'd and
renamed into place, so a reader never sees half of one; loading checks every tensor's name and
shape against the model first (``load_trainable``) and loads nothing that does not fit.

Paths: a run id and a name are single path components of a fixed alphabet (no ``/``, none
``.`` or ``..``), and nothing under ``ROOT`` that is a symbolic link is followed (a run, kind or
checkpoint folder that is one is refused or left out, and so is a file in a checkpoint that is
not a regular file: a FIFO would hang the worker), so every read and write stays in ``ROOT``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from torch import nn

from creditrl.bounded_json import read_json_file
from creditrl.tinker.messages import BadRequest
from creditrl.tinker.policy import LoraSpec, Policy
from creditrl.workers.checkpoint_io import CheckpointMismatchError, load_trainable, save_trainable

__all__ = ["KINDS", "CheckpointRef", "CheckpointStore"]

KINDS = {"weights": "training", "sampler_weights": "sampler"}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_RUN = re.compile(r"[A-Za-z0-9][A-Za-z0-9:._-]{0,255}")
META = "meta.json"


@dataclass(frozen=True)
class CheckpointRef:
    """A parsed ``tinker://RUN/KIND/NAME`` path."""

    run: str
    kind: str
    name: str

    @property
    def path(self) -> str:
        return f"tinker://{self.run}/{self.kind}/{self.name}"

    @classmethod
    def parse(cls, path: str) -> CheckpointRef:
        """BadRequest for anything but ``tinker://RUN/weights|sampler_weights/NAME``."""
        parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
        if len(parts) != 3 or parts[1] not in KINDS:
            raise BadRequest(f"{path!r} is not a tinker://RUN/weights|sampler_weights/NAME path")
        if not _RUN.fullmatch(parts[0]) or not _NAME.fullmatch(parts[2]) or ".." in parts[2]:
            raise BadRequest(f"{path!r} has a run id or name this service does not accept")
        return cls(parts[0], parts[1], parts[2])


class _Adapters(nn.Module):
    """The adapter parameters of a policy as a module of their own (the same Parameter
    objects), so the checkpoint I/O writes them and the optimizer's state alone."""

    def __init__(self, params: dict[str, nn.Parameter]) -> None:
        super().__init__()
        self.adapters = nn.ParameterDict({k.replace(".", "__"): v for k, v in params.items()})


def _fsync_tree(directory: Path) -> None:
    for path in [*directory.iterdir(), directory]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class CheckpointStore:
    """Checkpoints under ``root``, one folder per ``tinker://`` path."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def folder(self, ref: CheckpointRef) -> Path:
        return self.root / ref.run / ref.kind / ref.name

    def _no_links(self, ref: CheckpointRef) -> None:
        """BadRequest when the run, kind or checkpoint folder of ``ref`` is a symbolic link
        (never followed: it could lead out of ``root``)."""
        path = self.root
        for part in (ref.run, ref.kind, ref.name):
            path = path / part
            if path.is_symlink():
                raise BadRequest(f"checkpoint {ref.path}: {part} is a symbolic link, not followed")

    def has_run(self, run: str) -> bool:
        """Whether ``run`` (a valid run id) has a folder of its own under ``root``."""
        if not _RUN.fullmatch(run):
            return False
        path = self.root / run
        return path.is_dir() and not path.is_symlink()

    def save(self, policy: Policy, ref: CheckpointRef, overwrite: bool = False) -> str:
        """Write ``policy``'s adapters (and, for ``weights``, its Adam state); returns the
        ``tinker://`` path. BadRequest if it exists and not ``overwrite``."""
        if policy.lora is None:
            raise BadRequest("a model without LoRA adapters has no weights of its own to save")
        self._no_links(ref)
        target = self.folder(ref)
        if target.exists() and not overwrite:
            raise BadRequest(f"checkpoint {ref.path} already exists (pass overwrite=True)")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{ref.name}."))
        try:
            optimizer = policy.optimizer if ref.kind == "weights" else None
            io_meta = save_trainable(tmp, "adapter", _Adapters(policy.trainable()), optimizer, None)
            meta = {
                "base_model": policy.base_model,
                "lora": policy.lora.to_json(),
                "kind": ref.kind,
                "time": time.time(),
                "checkpoint_io": io_meta,
            }
            (tmp / META).write_text(json.dumps(meta), encoding="utf-8")
            _fsync_tree(tmp)
            if target.exists():
                shutil.rmtree(target)
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return ref.path

    def meta(self, ref: CheckpointRef) -> dict[str, Any]:
        """The checkpoint's meta.json; BadRequest (404) when there is none, BadRequest when a
        folder on its path is a link or a file in it is not a regular file."""
        self._no_links(ref)
        folder = self.folder(ref)
        path = folder / META
        if not path.is_file():
            raise BadRequest(f"no checkpoint {ref.path} on this service", status=404)
        for entry in folder.iterdir():
            if not stat.S_ISREG(entry.lstat().st_mode):
                raise BadRequest(
                    f"checkpoint {ref.path} is damaged: {entry.name} is not a regular file"
                )
        meta = read_json_file(path)
        if not isinstance(meta, dict) or not isinstance(meta.get("lora"), dict):
            raise BadRequest(f"checkpoint {ref.path} is damaged (meta.json)")
        return meta

    def lora_of(self, ref: CheckpointRef) -> tuple[str, LoraSpec]:
        """(base model, LoRA settings) a checkpoint was written for."""
        meta = self.meta(ref)
        lora = meta["lora"]
        try:
            spec = LoraSpec(
                rank=int(lora["rank"]),
                seed=lora.get("seed"),
                train_mlp=bool(lora.get("train_mlp", True)),
                train_attn=bool(lora.get("train_attn", True)),
                train_unembed=bool(lora.get("train_unembed", True)),
            )
        except (KeyError, TypeError, ValueError):
            raise BadRequest(f"checkpoint {ref.path} is damaged (LoRA settings)") from None
        return str(meta.get("base_model", "")), spec

    def load(self, policy: Policy, ref: CheckpointRef, optimizer: bool) -> None:
        """Load the adapters (and the Adam state when ``optimizer`` and it was saved) into
        ``policy``; nothing is loaded when a tensor does not fit."""
        meta = self.meta(ref)
        adapters = _Adapters(policy.trainable())
        opt = policy.optimizer if optimizer and ref.kind == "weights" else None
        try:
            load_trainable(self.folder(ref), "adapter", meta["checkpoint_io"], adapters, opt, None)
        except CheckpointMismatchError as err:
            raise BadRequest(str(err)) from None
        except (OSError, KeyError, TypeError, ValueError) as err:
            raise BadRequest(f"checkpoint {ref.path} cannot be read: {err}") from None
        policy.version += 1

    def listing(self, run: str | None = None) -> list[dict[str, Any]]:
        """The Tinker ``Checkpoint`` records of one run (or all), oldest first."""
        records: list[dict[str, Any]] = []
        if run is not None and not self.has_run(run):
            return records
        runs = [self.root / run] if run is not None else sorted(self.root.glob("*"))
        for run_dir in runs:
            if run_dir.is_symlink() or not _RUN.fullmatch(run_dir.name):
                continue
            for kind, kind_name in KINDS.items():
                if (run_dir / kind).is_symlink():
                    continue
                for folder in sorted((run_dir / kind).glob("*")):
                    meta_path = folder / META
                    if folder.name.startswith(".") or folder.is_symlink():
                        continue
                    if meta_path.is_symlink() or not meta_path.is_file():
                        continue
                    ref = CheckpointRef(run_dir.name, kind, folder.name)
                    sizes = [p.lstat() for p in folder.iterdir()]
                    size = sum(st.st_size for st in sizes if stat.S_ISREG(st.st_mode))
                    stamp = datetime.fromtimestamp(meta_path.stat().st_mtime, UTC)
                    records.append(
                        {
                            "checkpoint_id": f"{kind}/{folder.name}",
                            "checkpoint_type": kind_name,
                            "time": stamp.isoformat(),
                            "tinker_path": ref.path,
                            "size_bytes": size,
                        }
                    )
        return sorted(records, key=lambda r: r["time"])
