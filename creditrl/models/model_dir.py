"""Checks of a model directory before transformers reads it; a model directory may come from
anyone.

``check_model_dir``: every entry at the top level (and in ``additional_chat_templates/``) is a
regular file or folder inside the directory (a symlink may point into it, or, for a Hugging
Face cache snapshot ``.../snapshots/REV``, into the cache's ``blobs/``), never a device or a
pipe; weights are safetensors only (transformers would unpickle ``pytorch_model.bin``); each
``*.json`` is bounded in bytes, nesting and elements before anything decodes it, each chat
template (``*.jinja``) in bytes; ``config.json``
is a JSON object whose sizes (layers, hidden size, heads, vocabulary, ...) are within
``SIZE_BOUNDS``. ``check_memory``: the parameters the config implies, counted on the meta
device (nothing allocated), fit in the memory available. Each problem is one ``ModelError``
line naming the file or key.
"""

from __future__ import annotations

import itertools
import os
import stat
from pathlib import Path
from typing import Any

from creditrl.bounded_json import JsonLimits, read_json_file
from creditrl.errors import UserError

__all__ = [
    "CONFIG_LIMITS",
    "JSON_LIMITS",
    "MAX_ENTRIES",
    "PICKLE_WEIGHTS",
    "SIZE_BOUNDS",
    "SKIP_MEMORY_CHECK_ENV",
    "TEMPLATE_MAX_BYTES",
    "TOKENIZER_JSON_LIMITS",
    "ModelError",
    "ModelNotFoundError",
    "available_memory",
    "check_memory",
    "check_model_dir",
]

CONFIG_LIMITS = JsonLimits(max_bytes=4 << 20, max_depth=16, max_items=1 << 18)
JSON_LIMITS = JsonLimits(max_bytes=16 << 20, max_depth=32, max_items=1 << 21)
# tokenizer.json of a 262k-token vocabulary (Gemma 3) is 33 MB and ~3M elements
TOKENIZER_JSON_LIMITS = JsonLimits(max_bytes=64 << 20, max_depth=32, max_items=1 << 23)
# Entries of a model directory (a 405B model has ~200 files).
MAX_ENTRIES = 10_000
# A chat template file, read whole (real ones are a few kB, the longest ~30 kB).
TEMPLATE_MAX_BYTES = 1 << 20
# Weight files transformers would read with pickle (torch.load) or from other formats.
PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth")
SAFETENSORS_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
SUBDIRS_READ = ("additional_chat_templates",)
# The largest value each size key of config.json (or of a nested config) may hold; well above
# every released model (405B: 126 layers, hidden 16384; Gemma 3: vocabulary 262144).
_LAYERS, _WIDTH, _HEADS, _POSITIONS = 1000, 65536, 4096, 1 << 24
SIZE_BOUNDS = {
    "num_hidden_layers": _LAYERS,
    "n_layer": _LAYERS,
    "num_layers": _LAYERS,
    "hidden_size": _WIDTH,
    "n_embd": _WIDTH,
    "d_model": _WIDTH,
    "head_dim": _WIDTH,
    "intermediate_size": 1 << 20,
    "moe_intermediate_size": 1 << 20,
    "n_inner": 1 << 20,
    "ffn_dim": 1 << 20,
    "num_attention_heads": _HEADS,
    "n_head": _HEADS,
    "num_key_value_heads": _HEADS,
    "num_experts": _HEADS,
    "num_local_experts": _HEADS,
    "n_routed_experts": _HEADS,
    "vocab_size": 1 << 20,
    "max_position_embeddings": _POSITIONS,
    "n_positions": _POSITIONS,
    "n_ctx": _POSITIONS,
}
SKIP_MEMORY_CHECK_ENV = "CREDITRL_SKIP_MEMORY_CHECK"


class ModelError(UserError):
    """A model directory that creditrl will not load (names the file or key)."""


class ModelNotFoundError(ModelError, FileNotFoundError):
    """A model path that is no local model directory."""


def check_model_dir(directory: Path, weights: bool = True) -> None:
    """The checks above on ``directory`` (resolved); ``weights=False`` for a tokenizer alone."""
    roots = _allowed_roots(directory)
    for entry in _entries(directory):
        _check_entry(entry, roots)
        if entry.suffix == ".jinja" and (size := entry.stat().st_size) > TEMPLATE_MAX_BYTES:
            raise ModelError(f"{entry}: {size} bytes, above the limit of {TEMPLATE_MAX_BYTES}")
    if weights:
        _check_weights(directory)
    for path in sorted(p for p in directory.glob("*.json") if p.is_file()):
        limits = TOKENIZER_JSON_LIMITS if path.name == "tokenizer.json" else JSON_LIMITS
        with open(path, "rb") as f:
            data = f.read(limits.max_bytes + 1)
        try:
            limits.check(data)
        except ValueError as err:
            raise ModelError(f"{path}: {err}") from None
    config = directory / "config.json"
    if config.is_file():
        _check_sizes(_read_config(config), config, "")


def check_memory(directory: Path, dtype_bytes: int) -> None:
    """``ModelError`` when the model that ``directory/config.json`` describes needs more memory
    for its parameters (``dtype_bytes`` each) than is available; ``$CREDITRL_SKIP_MEMORY_CHECK``
    set to 1 skips this check."""
    if os.environ.get(SKIP_MEMORY_CHECK_ENV) == "1":
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config_file = directory / "config.json"
    try:
        config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (OSError, ValueError, KeyError, TypeError, ImportError) as err:
        raise ModelError(
            f"{config_file}: not a model transformers can build: {_line(err)}"
        ) from None
    count = sum(t.numel() for t in (*model.parameters(), *model.buffers()))
    needed, available = count * dtype_bytes, available_memory()
    if needed > available:
        sizes = _read_config(config_file)
        named = ", ".join(f"{k}={sizes[k]}" for k in SIZE_BOUNDS if isinstance(sizes.get(k), int))
        raise ModelError(
            f"{config_file}: the model it describes ({named}) holds {count:,} parameters, "
            f"{needed / 2**30:.1f} GiB at {dtype_bytes} bytes each, more than the "
            f"{available / 2**30:.1f} GiB of memory available; set "
            f"{SKIP_MEMORY_CHECK_ENV}=1 to load it anyway"
        )


def available_memory() -> int:
    """Bytes of memory available now: MemAvailable of /proc/meminfo, else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def _allowed_roots(directory: Path) -> tuple[Path, ...]:
    """Where the files of ``directory`` may live: in it, or in a Hugging Face cache's blobs."""
    if directory.parent.name == "snapshots":
        return directory, directory.parent.parent / "blobs"
    return (directory,)


def _entries(directory: Path) -> list[Path]:
    """The top-level entries and those of ``SUBDIRS_READ``; at most ``MAX_ENTRIES`` of each."""
    entries = _listing(directory)
    for name in SUBDIRS_READ:
        sub = directory / name
        if sub.is_dir() and not sub.is_symlink():
            entries.extend(_listing(sub))
    return entries


def _listing(directory: Path) -> list[Path]:
    entries = list(itertools.islice(directory.iterdir(), MAX_ENTRIES + 1))
    if len(entries) > MAX_ENTRIES:
        raise ModelError(f"{directory}: more than {MAX_ENTRIES} entries; not a model directory")
    return sorted(entries)


def _check_entry(entry: Path, roots: tuple[Path, ...]) -> None:
    target = Path(os.path.realpath(entry))
    if not any(target == root or target.is_relative_to(root) for root in roots):
        raise ModelError(
            f"{entry}: a link to {target}, outside the model directory; creditrl reads only "
            "files inside it"
        )
    try:
        mode = os.stat(target).st_mode
    except OSError as err:
        raise ModelError(f"{entry}: cannot be read ({err.strerror})") from None
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise ModelError(f"{entry}: not a regular file (a device, pipe or socket)")


def _check_weights(directory: Path) -> None:
    if any((directory / name).is_file() for name in SAFETENSORS_WEIGHTS):
        return
    pickled = [name for name in PICKLE_WEIGHTS if (directory / name).exists()]
    if pickled:
        raise ModelError(
            f"{directory / pickled[0]}: creditrl loads only safetensors weights (pickle files "
            "can run code when loaded); convert the model with save_pretrained("
            "safe_serialization=True) in a trusted environment"
        )
    raise ModelError(f"{directory} has no model.safetensors (nor model.safetensors.index.json)")


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = read_json_file(path, CONFIG_LIMITS)
    except (OSError, ValueError) as err:
        raise ModelError(f"{path}: not a readable JSON file: {_line(err)}") from None
    if not isinstance(config, dict):
        raise ModelError(f"{path}: not a JSON object but {type(config).__name__}")
    return config


def _check_sizes(config: dict[str, Any], path: Path, prefix: str) -> None:
    """Every size key of ``config`` and of the configs nested in it within ``SIZE_BOUNDS``."""
    for key, value in config.items():
        if isinstance(value, dict):
            _check_sizes(value, path, f"{prefix}{key}.")
        elif key in SIZE_BOUNDS and value is not None:
            bound = SIZE_BOUNDS[key]
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= bound:
                raise ModelError(
                    f"{path}: {prefix}{key} must be a whole number from 0 to {bound}, "
                    f"got {value!r:.40}"
                )


def _line(err: BaseException) -> str:
    return " ".join(str(err).split())[:300]
