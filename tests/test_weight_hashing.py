"""The hash that checks weights over the wire (creditrl.weights.hashing): SHA-256 on a CPU with
SHA extensions, BLAKE2b-256 otherwise, named in the manifest; a sampler checks with the one
named, whichever it is."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from creditrl.weights import WireChannel, WirePublisher
from creditrl.weights.hashing import HASHES, digest, wire_hash
from creditrl.weights.wire import Manifest, WireLimits, chunk_digests, whole_digest

FLAGS = "processor\t: 0\nflags\t\t: fpu sse2 avx2 {extra}\nbugs\t\t: none\n"


def test_the_cpu_flags_choose_the_hash(tmp_path: Path) -> None:
    with_sha, without = tmp_path / "sha", tmp_path / "plain"
    with_sha.write_text(FLAGS.format(extra="sha_ni avx512f"))
    without.write_text(FLAGS.format(extra="avx512f avx512_vnni"))
    assert wire_hash(with_sha) == ("sha256", "this CPU has SHA extensions")
    assert wire_hash(without) == ("blake2b", "no SHA extensions on this CPU")
    assert wire_hash(tmp_path / "absent") == ("blake2b", "no SHA extensions on this CPU")


def test_each_hash_is_its_256_bit_digest() -> None:
    assert digest(b"abc", "sha256") == (
        "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    )
    assert digest(b"abc", "blake2b") == hashlib.blake2b(b"abc", digest_size=32).hexdigest()
    assert digest(memoryview(b"abc"), "blake2b") == digest(b"abc", "blake2b")
    assert all(len(digest(b"", name)) == 64 for name in HASHES)
    with pytest.raises(ValueError, match="unknown weight hash 'md5'"):
        digest(b"abc", "md5")


def test_chunks_and_the_whole_are_hashed_with_the_hash_named() -> None:
    data = bytes(range(256)) * 40
    chunks = chunk_digests(data, 4096, "blake2b")
    assert chunks == tuple(
        hashlib.blake2b(data[i : i + 4096], digest_size=32).hexdigest()
        for i in range(0, len(data), 4096)
    )
    joined = b"".join(bytes.fromhex(c) for c in chunks)
    assert whole_digest(chunks, "blake2b") == hashlib.blake2b(joined, digest_size=32).hexdigest()
    assert chunk_digests(data, 4096, "sha256") != chunks


@pytest.mark.parametrize("name", HASHES)
def test_a_sampler_loads_a_publication_hashed_with_either(name: str) -> None:
    from conftest import tiny_llama_config

    torch.manual_seed(0)
    learner = LlamaForCausalLM(tiny_llama_config()).float().eval()
    torch.manual_seed(1)
    sampler = LlamaForCausalLM(tiny_llama_config()).float().eval()
    publisher = WirePublisher(chunk_bytes=1 << 16, hash_name=name)
    manifest = publisher.publish(learner, 1)
    assert manifest.hash == name and manifest.as_dict()["hash"] == name
    assert Manifest.parse(manifest.as_dict(), WireLimits()) == manifest
    channel = WireChannel(publisher)
    assert channel.load(sampler) is True and channel.version == 1
    sa, sb = sampler.state_dict(), learner.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sb)


def test_a_publisher_refuses_an_unknown_hash() -> None:
    with pytest.raises(ValueError, match="hash_name must be one of"):
        WirePublisher(hash_name="crc32")
