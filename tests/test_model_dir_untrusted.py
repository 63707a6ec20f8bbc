"""Model directories from anyone: each hostile one is one line naming the file or key, from the
loaders, from preflight and through `creditrl eval` / `creditrl train` (exit 2), before
transformers reads it or any weights are allocated."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from creditrl.cli import main
from creditrl.config.loader import load_config
from creditrl.models import chat_template, load_causal_lm, load_tokenizer, model_dir
from creditrl.models.critic import CriticModel
from creditrl.models.loading import local_model_dir
from creditrl.models.model_dir import ModelError
from creditrl.models.tiny import tiny_model_dir
from creditrl.preflight import preflight

NESTED_LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
GROWING_OUTPUT = "{% set s = 'x' * 100000 %}{% for i in range(100000) %}{{ s }}{% endfor %}"


@pytest.fixture(autouse=True)
def short_render_bound(monkeypatch) -> None:
    monkeypatch.setattr(chat_template, "RENDER_TIME_S", 1.0)


def copy_tiny(tmp_path: Path, name: str = "model") -> Path:
    target = tmp_path / name
    shutil.copytree(tiny_model_dir(), target)
    return target


def edit_config(directory: Path, **changes) -> None:
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **changes}))


class RunsCode:
    """Unpickling this touches ``path``: what a pickle weights file may do."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (shutil.copyfile, ("/dev/null", self.path))


def pickle_weights(d: Path) -> None:
    tensors = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    torch.save({**tensors, "x": RunsCode(d.parent / "ran")}, d / "pytorch_model.bin")


def symlinked_weights(d: Path) -> None:
    (d / "model.safetensors").unlink()
    os.symlink("/etc/passwd", d / "model.safetensors")


def fifo_tokenizer(d: Path) -> None:
    (d / "tokenizer.json").unlink()
    os.mkfifo(d / "tokenizer.json")


def nested_tokenizer(d: Path) -> None:
    (d / "tokenizer.json").write_text("[" * 100_000 + "]" * 100_000)


def many_layers(d: Path) -> None:
    edit_config(d, num_hidden_layers=100_000)


def looping_template(d: Path) -> None:
    (d / "chat_template.jinja").write_text(NESTED_LOOPS)


# (how to spoil the tiny model, what the one line names)
HOSTILE: dict[str, tuple[Callable[[Path], None], str]] = {
    "pickle": (pickle_weights, r"pytorch_model\.bin: creditrl loads only safetensors"),
    "symlink": (symlinked_weights, r"model\.safetensors: a link to /etc/passwd, outside"),
    "fifo": (fifo_tokenizer, r"tokenizer\.json: not a regular file"),
    "nested_json": (nested_tokenizer, r"tokenizer\.json: nested 100000 deep, above the limit"),
    "layers": (many_layers, r"config\.json: num_hidden_layers must be .* to 1000, got 100000"),
    "template": (looping_template, r"chat_template\.jinja: the chat template did not finish"),
}


def hostile_dir(tmp_path: Path, case: str) -> Path:
    directory = copy_tiny(tmp_path)
    HOSTILE[case][0](directory)
    return directory


def one_error_line(capsys, code: int) -> str:
    """The CLI exited 2 and printed one 'error:' line and no traceback; that line."""
    captured = capsys.readouterr()
    out = captured.out + captured.err
    assert code == 2, out
    errors = [line for line in out.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in out, out
    return errors[0]


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_model_dir_is_one_line_from_the_loaders(tmp_path: Path, case: str) -> None:
    directory = hostile_dir(tmp_path, case)
    message = HOSTILE[case][1]
    loader = load_tokenizer if case == "template" else load_causal_lm
    with pytest.raises(ModelError, match=message):
        loader(directory)
    cfg = load_config(overrides=[f"model.path={directory}"])
    with pytest.raises(ModelError, match=message):
        preflight(cfg)
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("case", sorted(HOSTILE))
@pytest.mark.parametrize("command", ["eval", "train"])
def test_hostile_model_dir_is_one_line_in_the_cli(
    tmp_path: Path, capsys, case: str, command: str
) -> None:
    directory = hostile_dir(tmp_path, case)
    if command == "eval":
        code = main(["eval", str(directory)])
    else:
        code = main(["train", f"model.path={directory}", f"trainer.output_dir={tmp_path / 'run'}"])
    line = one_error_line(capsys, code)
    assert str(directory) in line
    assert re.search(HOSTILE[case][1], line), line
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("command", ["eval", "train"])
def test_a_folder_that_is_no_model_is_one_line(tmp_path: Path, capsys, command: str) -> None:
    (tmp_path / "notes.txt").write_text("not a model")
    code = main(
        [command, f"model.path={tmp_path}", f"trainer.output_dir={tmp_path / 'run'}"]
        if command == "train"
        else [command, f"model.path={tmp_path}"]
    )
    assert str(tmp_path) in one_error_line(capsys, code)


def test_critic_path_is_checked_too(tmp_path: Path) -> None:
    directory = hostile_dir(tmp_path, "symlink")
    with pytest.raises(ModelError, match=r"model\.safetensors: a link to /etc/passwd"):
        CriticModel.from_actor(directory)
    cfg = load_config(
        overrides=[
            f"model.path={tiny_model_dir()}",
            f"model.critic_path={directory}",
            "algorithm.adv_estimator=gae",
        ]
    )
    with pytest.raises(ModelError, match=r"model\.safetensors: a link"):
        preflight(cfg)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"hidden_size": "64"}, r"config\.json: hidden_size must be a whole number .*'64'"),
        ({"vocab_size": True}, r"config\.json: vocab_size must be"),
        ({"text_config": {"num_attention_heads": -1}}, r"text_config\.num_attention_heads"),
        ({"max_position_embeddings": 1 << 30}, r"max_position_embeddings must be .* 16777216"),
    ],
)
def test_config_sizes_are_bounded(tmp_path: Path, changes: dict, message: str) -> None:
    directory = copy_tiny(tmp_path)
    edit_config(directory, **changes)
    with pytest.raises(ModelError, match=message):
        local_model_dir(directory)


def test_config_json_must_be_a_bounded_object(tmp_path: Path) -> None:
    directory = copy_tiny(tmp_path)
    (directory / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelError, match=r"config\.json: not a JSON object but list"):
        load_causal_lm(directory)
    (directory / "config.json").write_text("{" * 64 + "}" * 64)
    with pytest.raises(ModelError, match=r"config\.json: .*nested 64 deep"):
        load_causal_lm(directory)


def test_what_transformers_refuses_is_one_line(tmp_path: Path) -> None:
    directory = copy_tiny(tmp_path)
    edit_config(directory, model_type="no_such_architecture")
    with pytest.raises(ModelError, match=r"config\.json: not a model transformers can build"):
        load_causal_lm(directory)
    edit_config(directory, model_type="llama")
    (directory / "model.safetensors").write_bytes(b"\xff" * 64)  # a header of 2**64 - 1 bytes
    with pytest.raises(ModelError, match=r"model directory .* cannot be loaded: .*header"):
        load_causal_lm(directory)


def test_a_directory_of_too_many_entries_is_refused(tmp_path: Path) -> None:
    directory = copy_tiny(tmp_path)
    for i in range(model_dir.MAX_ENTRIES):
        (directory / f"extra{i}").touch()
    with pytest.raises(ModelError, match=r"more than 10000 entries"):
        local_model_dir(directory)


def test_implied_memory_is_checked_before_allocating(tmp_path: Path, monkeypatch) -> None:
    huge = copy_tiny(tmp_path, "huge")  # within every bound, ~50 T parameters
    edit_config(huge, num_hidden_layers=1000, hidden_size=65536, intermediate_size=262144)
    with pytest.raises(ModelError, match=r"huge/config\.json: .*num_hidden_layers=1000.*GiB"):
        load_causal_lm(huge)
    directory = copy_tiny(tmp_path)
    monkeypatch.setattr(model_dir, "available_memory", lambda: 1000)
    with pytest.raises(ModelError, match=r"more than the 0\.0 GiB .*CREDITRL_SKIP_MEMORY_CHECK=1"):
        load_causal_lm(directory, dtype="bf16")
    monkeypatch.setenv("CREDITRL_SKIP_MEMORY_CHECK", "1")
    assert load_causal_lm(directory).config.num_hidden_layers == 2


def test_template_growing_without_bound_in_memory(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(chat_template, "RENDER_TIME_S", 60.0)  # the memory bound comes first
    directory = copy_tiny(tmp_path)
    (directory / "chat_template.jinja").write_text(GROWING_OUTPUT)
    with pytest.raises(ModelError, match=r"chat_template\.jinja: .*needed more than 1024 MiB"):
        load_tokenizer(directory)


def test_template_in_tokenizer_config_is_named(tmp_path: Path) -> None:
    directory = copy_tiny(tmp_path)
    (directory / "chat_template.jinja").unlink()
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["chat_template"] = NESTED_LOOPS
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=r"tokenizer_config\.json: the chat template did not"):
        load_tokenizer(directory)


def test_template_looping_only_when_given_tools_is_refused(tmp_path: Path) -> None:
    directory = copy_tiny(tmp_path)
    template = "{% if tools %}" + NESTED_LOOPS + "{% endif %}{{ messages[0].content }}"
    (directory / "chat_template.jinja").write_text(template)
    with pytest.raises(ModelError, match=r"chat_template\.jinja: the chat template did not"):
        load_tokenizer(directory)


def test_every_named_template_is_bounded(tmp_path: Path) -> None:
    directory = copy_tiny(tmp_path)
    (directory / "additional_chat_templates").mkdir()
    (directory / "additional_chat_templates" / "tool_use.jinja").write_text(NESTED_LOOPS)
    with pytest.raises(ModelError, match=r"additional_chat_templates/tool_use\.jinja: the chat"):
        load_tokenizer(directory)


def test_template_file_is_bounded_in_bytes(tmp_path: Path) -> None:
    directory = copy_tiny(tmp_path)
    (directory / "chat_template.jinja").write_text("x" * (2 << 20))
    with pytest.raises(ModelError, match=r"chat_template\.jinja: 2097152 bytes, above the limit"):
        load_tokenizer(directory)


def test_template_errors_are_left_to_the_real_render(tmp_path: Path) -> None:
    directory = copy_tiny(tmp_path)
    (directory / "chat_template.jinja").write_text("{{ raise_exception('no system role') }}")
    tokenizer = load_tokenizer(directory)
    with pytest.raises(Exception, match="no system role"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)


def test_hugging_face_cache_snapshot_with_blob_links_loads(tmp_path: Path) -> None:
    """snapshots/REV/NAME -> ../../blobs/HASH is how the hub cache stores a model."""
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "rev0"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for i, source in enumerate(sorted(tiny_model_dir().iterdir())):
        shutil.copyfile(source, blobs / f"blob{i}")
        os.symlink(f"../../blobs/blob{i}", snapshot / source.name)
    assert load_tokenizer(snapshot).eos_token == "<|im_end|>"
    assert load_causal_lm(snapshot).config.num_hidden_layers == 2


def test_a_link_inside_the_directory_is_fine(tmp_path: Path) -> None:
    directory = copy_tiny(tmp_path)
    (directory / "model.safetensors").rename(directory / "weights.bin.safetensors")
    os.symlink("weights.bin.safetensors", directory / "model.safetensors")
    assert load_causal_lm(directory).config.vocab_size == 49152
