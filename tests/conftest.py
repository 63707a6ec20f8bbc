"""Fixtures shared by the rollout-engine tests (HF and vLLM): the real tokenizer and a tiny
random Llama whose logits are spread enough (initializer_range 0.2) for sampling to vary; and,
for every test, the CPU as ``trainer.device=auto``'s answer unless the test is marked gpu; and
the groups ``make test`` runs its two processes by (pytest-xdist ``--dist loadgroup``)."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from creditrl.models.tiny import tiny_model_dir
from creditrl.models.tokenizer import load_tokenizer
from creditrl.workers import placement

# Files that start a local Ray cluster: two at once would find each other's (Ray connects to an
# existing local cluster), so they run one after another in one process.
RAY_FILES = {
    "test_distributed.py",
    "test_loopback.py",
    "test_ray_cluster.py",
    "test_ray_sampler_restart.py",
    "test_scale_out.py",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Each test file is one group (its module fixtures are built once), the Ray files one
    group together: under ``-n 2 --dist loadgroup`` a group runs in one process."""
    for item in items:
        name = item.path.name
        item.add_marker(pytest.mark.xdist_group("ray" if name in RAY_FILES else name))


@pytest.fixture(autouse=True)
def _cpu_unless_marked_gpu(request, monkeypatch) -> None:
    """Outside the tests marked ``gpu``, ``trainer.device=auto`` sees no CUDA: the suite runs
    (and its figures hold) on the CPU on a GPU machine too."""
    if request.node.get_closest_marker("gpu") is None:
        monkeypatch.setattr(placement, "cuda_visible", lambda: False)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(tiny_model_dir())


def tiny_llama_config() -> LlamaConfig:
    """The tiny random Llama of the tests: the real tokenizer's vocabulary, 2 layers."""
    return LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    config = tiny_llama_config()
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float().eval()
