"""A LoRA head tied to the input embeddings (``model.target_modules`` with ``lm_head`` on a model
with ``tie_word_embeddings``, as the tiny model and SmolLM2 have): merged, the head is no
longer the embeddings. The merged weights must reach a plain model with the head merged and the
embeddings unchanged: the async channel's ``lora_sync=merged`` (``apply_state``, in process and
through a weight folder), ``creditrl export``'s merged model and a run's actor as a teacher
(``merged_model``), and the sampler's merged copy. Before the fix one tensor overwrote the
other in the tied model (the embeddings became the merged head: logits off by ~1.6)."""

from __future__ import annotations

import pytest
import torch

from creditrl.models import apply_lora, load_causal_lm
from creditrl.models.tiny import tiny_model_dir
from creditrl.rollout.merged_copy import MergedCopy
from creditrl.weights import WeightPublisher, WeightSubscriber
from creditrl.weights.tensors import apply_state, merged_model, merged_state_dict

pytestmark = pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`:UserWarning")

IDS = torch.tensor([[1, 520, 9, 33, 4001, 77, 12, 3000]])
# Merged W' x against W x + s B (A x) in float32: the tiny model's logits (|logit| <= 6) differ
# by rounding only, ~100 products of unit roundoff 6e-8 each: far below 1e-4 (measured 4e-7).
# The bug moved them by ~1.6.
ATOL = 1e-4


def tied_lora(targets: str = "q_proj,lm_head") -> torch.nn.Module:
    """The tiny model (tied embeddings) with rank-4 adapters on ``targets`` whose B is random."""
    base = load_causal_lm(tiny_model_dir())
    assert base.lm_head.weight is base.model.embed_tokens.weight
    torch.manual_seed(0)
    lora = apply_lora(base, rank=4, alpha=8, target_modules=targets)
    with torch.no_grad():
        for name, param in lora.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    return lora.eval()


@torch.no_grad()
def logits(model: torch.nn.Module) -> torch.Tensor:
    return model(input_ids=IDS).logits


def assert_is_the_lora_model(plain: torch.nn.Module, lora: torch.nn.Module) -> None:
    embeddings = lora.get_base_model().model.embed_tokens.weight
    assert torch.equal(plain.model.embed_tokens.weight, embeddings)
    torch.testing.assert_close(logits(plain), logits(lora), atol=ATOL, rtol=0)


def test_merged_weights_load_into_a_plain_tied_model_untied():
    lora = tied_lora()
    state = merged_state_dict(lora)
    assert not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    plain = load_causal_lm(tiny_model_dir())
    apply_state(plain, "merged", state, "the test's version")
    assert plain.lm_head.weight is not plain.model.embed_tokens.weight
    assert not plain.config.tie_word_embeddings
    assert torch.equal(plain.lm_head.weight, state["lm_head.weight"])
    assert_is_the_lora_model(plain, lora)
    apply_state(plain, "merged", merged_state_dict(lora), "again")  # a later version: in place
    assert_is_the_lora_model(plain, lora)


def test_an_unadapted_tied_head_stays_tied():
    lora = tied_lora("q_proj,v_proj")
    plain = load_causal_lm(tiny_model_dir())
    apply_state(plain, "merged", merged_state_dict(lora), "the test's version")
    assert plain.lm_head.weight is plain.model.embed_tokens.weight
    assert plain.config.tie_word_embeddings
    assert_is_the_lora_model(plain, lora)


def test_a_weight_folder_carries_the_merged_head(tmp_path):
    lora = tied_lora()
    publisher = WeightPublisher(tmp_path / "weights", 2, "merged")
    try:
        publisher.publish(lora, 1)
        plain = load_causal_lm(tiny_model_dir())
        assert WeightSubscriber(tmp_path / "weights").maybe_load(plain, 0) == 1
    finally:
        publisher.lock.release()
    assert_is_the_lora_model(plain, lora)


def test_the_exported_and_teacher_model_is_merged_into_the_head_only(tmp_path):
    lora = tied_lora()
    expected = logits(lora)
    embeddings = lora.get_base_model().model.embed_tokens.weight.clone()
    plain = merged_model(lora)
    assert not plain.config.tie_word_embeddings
    assert torch.equal(plain.model.embed_tokens.weight, embeddings)
    torch.testing.assert_close(logits(plain), expected, atol=ATOL, rtol=0)
    plain.save_pretrained(str(tmp_path))  # what creditrl export's write_merged writes
    reloaded = load_causal_lm(tmp_path)
    assert torch.equal(reloaded.model.embed_tokens.weight, embeddings)
    torch.testing.assert_close(logits(reloaded), expected, atol=ATOL, rtol=0)


def test_the_merged_copy_unties_the_head_and_is_the_lora_model():
    """The sampler's copy (the engine's sampling through it: tests/test_lora_sampling.py)."""
    lora = tied_lora()
    copy_ = MergedCopy().refreshed(lora)
    assert copy_ is not None
    assert copy_.lm_head.weight is not copy_.model.embed_tokens.weight
    assert_is_the_lora_model(copy_, lora)
