"""The weight channel (``creditrl.weights``): publish a model's weights under a version, ask
for the newest, load it into a model or hand an engine its folder; the version the sampling
side holds lives in the channel, and the rollouts that sample read it there.

Models: two small ``torch.nn`` stacks (different seeds, so a load is seen) and, for a consumer,
the conftest's tiny Llama under the HF engine."""

from __future__ import annotations

import copy
import inspect
import json
from pathlib import Path

import pytest
import torch

from creditrl.asynchronous.learner import Learner
from creditrl.asynchronous.partial import PartialRollout
from creditrl.asynchronous.sampler import Sampler
from creditrl.batch import Batch, position_ids_from_mask
from creditrl.config.schema import RolloutConfig
from creditrl.rollout import HFRolloutEngine
from creditrl.rollout.continuation import EngineTurnGenerator
from creditrl.weights import FolderChannel, InProcessChannel, WeightChannel


def _tiny(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))


def _trained(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` with every weight moved: a newer version."""
    trained = copy.deepcopy(model)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01)
    return trained


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    other = b.state_dict()
    return all(torch.equal(v, other[k]) for k, v in a.state_dict().items())


def test_in_process_publish_newest_and_load_into_a_model() -> None:
    channel = InProcessChannel()
    trained, sampling = _tiny(0), _tiny(1)
    assert isinstance(channel, WeightChannel) and channel.newest() is None
    assert not channel.load(sampling) and channel.version == 0  # nothing published
    channel.publish(trained, 1)
    assert channel.newest() == 1 and channel.version == 0  # no consumer took it yet
    after = []
    assert channel.load(sampling, then=lambda: after.append(channel.newest()))
    assert channel.version == 1 and after == [1] and _same(sampling, trained)
    assert not channel.load(sampling, then=lambda: after.append(0)) and after == [1]
    with pytest.raises(TypeError, match="publishes no folders"):
        channel.load_folder(lambda folder: None)


def test_in_process_push_takes_every_publication_at_once() -> None:
    """The synchronous trainer's channel: publishing pushes to the engine (the consumer) and
    the version is held from then on; refresh has nothing to load."""
    pushed = []
    channel = InProcessChannel(lambda: pushed.append(1))
    model = _tiny(0)
    channel.publish(model, 0)
    channel.publish(model, 1)
    assert pushed == [1, 1] and channel.version == channel.newest() == 1
    assert not channel.refresh() and not channel.load(model)


def test_folder_publish_newest_load_and_folders(tmp_path: Path) -> None:
    """The async folder: ``vNNNNNNNN/`` + ``latest`` as before; a reader loads the newest into
    a model or hands its folder to an engine; the publisher holds no version of its own."""
    root = tmp_path / "weights"
    publisher = FolderChannel(root, publish=True, keep=2)
    reader = FolderChannel(root)
    trained, sampling = _tiny(0), _tiny(1)
    try:
        assert reader.newest() is None and not reader.load(sampling) and reader.version == 0
        publisher.publish(trained, 3)
        assert json.loads((root / "latest").read_text()) == {"version": 3, "dir": "v00000003"}
        meta = json.loads((root / "v00000003" / "meta.json").read_text())
        assert meta["version"] == 3 and meta["kind"] == "full"
        assert publisher.newest() == reader.newest() == 3
        assert reader.load(sampling) and reader.version == 3 and _same(sampling, trained)
        assert not reader.load(sampling) and publisher.version == 0
        publisher.publish(_tiny(2), 4, background=True)
        publisher.wait()
        folders: list[Path] = []
        assert reader.load_folder(folders.append) and folders == [root / "v00000004"]
        assert reader.version == 4 and not reader.load_folder(folders.append)
        publisher.publish(trained, 5)
        assert sorted(p.name for p in root.glob("v*")) == ["v00000004", "v00000005"]  # keep=2
        with pytest.raises(RuntimeError, match="publish=True"):
            reader.publish(trained, 6)
        (root / "latest").write_text(json.dumps({"version": 5, "dir": "../elsewhere"}))
        with pytest.raises(ValueError, match="names folder"):
            reader.load(sampling)  # the pointer's checks hold
    finally:
        publisher.lock.release()


def test_attach_names_what_refresh_loads(tmp_path: Path) -> None:
    root = tmp_path / "weights"
    publisher = FolderChannel(root, publish=True)
    reader = FolderChannel(root)
    with pytest.raises(ValueError, match="one of them"):
        reader.attach()
    sampling, pushed = _tiny(1), []
    reader.attach(sampling, then=lambda: pushed.append(reader.newest()))
    try:
        assert not reader.refresh()
        publisher.publish(_tiny(0), 1)
        assert reader.refresh() and pushed == [1] and reader.version == 1
        assert _same(sampling, _tiny(0)) and not reader.refresh()
    finally:
        publisher.lock.release()


def _prompts() -> Batch:
    ids = torch.tensor([[0, 1, 520, 9], [1, 12, 13, 14]])
    mask = (ids != 0).long()
    return Batch(
        {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask)}
    )


def test_the_version_is_held_once_and_seen_by_the_rollouts(tmp_path, model, tokenizer) -> None:
    """One reader channel serves the partial rollout and the turn generator: neither keeps a
    version of its own; the tokens sampled after a publication carry the channel's version,
    and the engine samples with the published weights. The learner's and the sampler's
    ``version`` are their channel's."""
    root = tmp_path / "weights"
    publisher = FolderChannel(root, publish=True)
    reader = FolderChannel(root)
    cfg = RolloutConfig(max_response_length=4, temperature=1.0, micro_batch_size=8)
    engine = HFRolloutEngine(model, tokenizer, cfg, seed=0)
    reader.attach(model)
    partial = PartialRollout(
        engine, tokenizer, max_response_length=4, chunk_tokens=2, weights=reader
    )
    turns = EngineTurnGenerator(engine, tokenizer)
    turns.weights = reader
    trained = _trained(model)
    try:
        publisher.publish(trained, 7)
        out = partial.generate(_prompts())
        assert torch.equal(out["token_weight_version"], out["response_mask"] * 7)
        assert reader.version == 7 and _same(model, trained)
        assert turns._refreshed() == 7  # the same channel, the same version
        for consumer in (partial, turns):
            assert "version" not in vars(consumer)
    finally:
        publisher.lock.release()
    for owner in (Learner, Sampler):
        assert isinstance(inspect.getattr_static(owner, "version"), property), owner
