"""Weights over the wire (creditrl.weights.wire): a publication as checksummed chunks, fetched
through a source that may drop, loaded only when complete, never pickled."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM

from creditrl.weights import InProcessChannel
from creditrl.weights.wire import (
    Manifest,
    RateLimit,
    WireAssembler,
    WireChannel,
    WireError,
    WireLimits,
    WirePublisher,
    decode_publication,
    encode_publication,
)


def tiny(seed: int) -> LlamaForCausalLM:
    from conftest import tiny_llama_config

    config = tiny_llama_config()
    config.tie_word_embeddings = True
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float().eval()


class Flaky:
    """A source over a publisher whose connection drops after ``drop_after`` chunks each call,
    and which may corrupt one chunk once."""

    def __init__(self, publisher: WirePublisher, drop_after: int | None = None,
                 corrupt: int | None = None) -> None:  # fmt: skip
        self.publisher, self.drop_after, self.corrupt = publisher, drop_after, corrupt
        self.served: list[int] = []
        self._this_call = 0

    def newest(self) -> int | None:
        self._this_call = 0
        return self.publisher.newest()

    def manifest(self, version: int) -> dict[str, Any]:
        return self.publisher.manifest(version)

    def chunk(self, version: int, index: int) -> bytes:
        if self.drop_after is not None and self._this_call >= self.drop_after:
            raise ConnectionError("dropped")
        self._this_call += 1
        self.served.append(index)
        data = self.publisher.chunk(version, index)
        if index == self.corrupt:
            self.corrupt = None
            return bytes([data[0] ^ 1]) + data[1:]
        return data


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_a_publication_round_trips_with_tied_tensors_once() -> None:
    model = tiny(0)
    state = model.state_dict()
    manifest, payload = encode_publication("full", state, 3, chunk_bytes=1 << 16)
    assert manifest.size == len(payload) and len(manifest.chunks) == -(-len(payload) // (1 << 16))
    tensors = decode_publication(payload)
    assert tensors.keys() == state.keys()
    assert tensors["lm_head.weight"] is tensors["model.embed_tokens.weight"]  # stored once
    assert all(torch.equal(tensors[k], state[k]) for k in state)
    assert Manifest.parse(manifest.as_dict(), WireLimits()) == manifest


def test_the_sampler_loads_only_a_complete_checked_version_and_resumes_after_a_drop() -> None:
    """The connection drops after 3 chunks each call: nothing is applied until every chunk is
    in, and no chunk is fetched twice (the ones held survive the drop); a corrupted chunk is
    rejected, counted and fetched again."""
    learner, sampler = tiny(0), tiny(1)
    publisher = WirePublisher(chunk_bytes=1 << 16)
    manifest = publisher.publish(learner, 1)
    source = Flaky(publisher, drop_after=3, corrupt=2)
    channel = WireChannel(source)
    before = copy.deepcopy(sampler.state_dict())
    calls = 0
    while not channel.load(sampler):
        calls += 1
        assert all(torch.equal(v, before[k]) for k, v in sampler.state_dict().items())
        assert calls < 10 * len(manifest.chunks)
    assert channel.version == 1 and same_weights(sampler, learner)
    assert sorted(source.served) == sorted([*range(len(manifest.chunks)), 2])  # 2 twice
    assert channel.load(sampler) is False  # nothing newer


def test_a_newer_version_replaces_a_half_fetched_one() -> None:
    learner, sampler = tiny(0), tiny(1)
    publisher = WirePublisher(chunk_bytes=1 << 16)
    publisher.publish(learner, 1)
    channel = WireChannel(Flaky(publisher, drop_after=1))
    assert channel.load(sampler) is False
    with torch.no_grad():
        learner.model.norm.weight.add_(1.0)
    publisher.publish(learner, 2)
    channel.source = Flaky(publisher)
    assert channel.load(sampler) is True and channel.version == 2
    assert same_weights(sampler, learner)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"size": -1}, "size is not an integer"),
        ({"size": True}, "size is not an integer"),
        ({"size": 1 << 40}, r"size is not an integer in \[0, 1048576\]"),
        ({"kind": "pickle"}, "kind 'pickle' is not one of"),
        ({"digest": "zz"}, "digest is not 64 hex"),
        ({"hash": "md5"}, "hash 'md5' is not one of"),
        ({"hash": None}, "hash 'None' is not one of"),
        ({"hash": "blake2b"}, "digest is not the digest of its chunks' digests"),
        ({"chunk_bytes": 0}, "chunks do not cut"),
        ({"chunks": ["0" * 64] * 3}, "chunks do not cut"),
        ({"chunks": "x"}, "chunks is not a list"),
        ({"chunk_bytes": 1 << 30}, "chunk_bytes is not an integer"),
        ({"digest": "0" * 64}, "digest is not the digest of its chunks' digests"),
    ],
)
def test_a_forged_manifest_is_refused_before_a_byte_is_asked_for(
    change: dict[str, Any], message: str
) -> None:
    manifest, _ = encode_publication("full", {"w": torch.ones(4)}, 1, chunk_bytes=8)
    fields = {**manifest.as_dict(), **change}
    with pytest.raises(WireError, match=message):
        Manifest.parse(fields, WireLimits(max_bytes=1 << 20, max_chunk_bytes=1 << 20))


def test_chunks_out_of_place_are_rejected_and_a_bad_whole_is_refused() -> None:
    manifest, payload = encode_publication("full", {"w": torch.arange(64.0)}, 1, chunk_bytes=64)
    assembler = WireAssembler(manifest)
    assert not assembler.add(-1, payload[:64]) and not assembler.add("0", payload[:64])
    assert not assembler.add(0, payload[:63]) and not assembler.add(0, bytearray(payload[:64]))
    assert assembler.rejected == 4
    with pytest.raises(WireError, match="chunks missing"):
        assembler.payload()
    for i in assembler.missing():
        assert assembler.add(i, payload[i * 64 : (i + 1) * 64])
    assert decode_publication(assembler.payload())["w"].equal(torch.arange(64.0))
    with pytest.raises(WireError, match="not safetensors"):
        decode_publication(b"\xff" * 64)


def test_the_publisher_keeps_the_newest_and_names_a_pruned_version() -> None:
    publisher = WirePublisher(keep=1, chunk_bytes=1 << 16)
    model = tiny(0)
    publisher.publish(model, 1)
    publisher.publish(model, 2)
    assert publisher.newest() == 2
    with pytest.raises(WireError, match="version 1 is not held"):
        publisher.chunk(1, 0)
    with pytest.raises(WireError, match="has no chunk"):
        publisher.chunk(2, 10**6)


def test_the_rate_limit_spreads_bytes_over_time() -> None:
    """At 100 bytes/s, 350 bytes after a full one-second burst wait 2.5 s (a fake clock)."""
    now, slept = [0.0], []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    limit = RateLimit(100, clock=lambda: now[0], sleep=sleep)
    for _ in range(7):
        limit.take(50)
    assert sum(slept) == pytest.approx(2.5)


def test_a_lora_run_sends_the_adapter_only() -> None:
    """asynchronous.lora_sync=adapter: the publication holds only the LoRA tensors, and a
    sampler with the same wrapping loads them."""
    from peft import LoraConfig, get_peft_model

    def lora(seed: int) -> torch.nn.Module:
        torch.manual_seed(seed)
        config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        model = get_peft_model(tiny(0), config)
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param)
        return model

    learner, sampler = lora(1), lora(2)
    publisher = WirePublisher(lora_sync="adapter", chunk_bytes=1 << 16)
    manifest = publisher.publish(learner, 1)
    assert manifest.kind == "adapter"
    channel = WireChannel(publisher)
    assert channel.load(sampler) and same_weights(sampler, learner)


def test_the_wire_channel_is_a_weight_channel_beside_the_in_process_one() -> None:
    channel = WireChannel(WirePublisher())
    assert channel.newest() is None and channel.refresh() is False
    with pytest.raises(TypeError, match="learner publishes"):
        channel.publish(tiny(0), 1)
    assert isinstance(channel, type(InProcessChannel()).__mro__[1])
