"""Sequence packing and token-budget micro-batches give the padded, fixed-size results."""

import copy
import json

import pytest
import torch
from helpers import padded_batch, small_llama_config, spy_grads, tiny_lm_with_attn
from transformers import LlamaModel

from creditrl import Batch
from creditrl.config import ActorConfig, CriticConfig, OptimConfig
from creditrl.models.critic import CriticModel
from creditrl.workers import ActorWorker, CriticWorker, policy_forward, value_forward
from creditrl.workers.micro_batches import (
    micro_batch_indices,
    micro_batches_for,
    resolve_on_cuda,
    restore_order,
    sequence_lengths,
)
from creditrl.workers.packing import pack, packed_policy_forward, packed_value_forward


def tiny_critic(seed: int = 1) -> CriticModel:
    torch.manual_seed(seed)
    head = torch.nn.Linear(32, 1)  # random, not CriticModel's zero init: values must differ
    return CriticModel(LlamaModel(small_llama_config()).float(), head)


PROMPTS = [6, 2, 4, 5, 1, 3]
RESPONSES = [5, 1, 3, 4, 2, 0]


def make_batch(prompt_lens=PROMPTS, response_lens=RESPONSES, p=6, t=5, seed=0) -> Batch:
    """``helpers.padded_batch``, with an observation token (response mask 0, attention 1)
    inside row 0's response, as a multi-turn rollout writes it."""
    batch = padded_batch(prompt_lens, response_lens, p=p, t=t, seed=seed)
    if response_lens[0] > 2:
        batch["response_mask"][0, 2] = 0
    return batch


def test_pack_layout_and_alignment() -> None:
    batch = make_batch([2, 1], [2, 1], p=3, t=3)
    packed = pack(batch)
    ids = batch["input_ids"]
    assert packed.input_ids.tolist() == [[*ids[0, 1:5].tolist(), *ids[1, 2:4].tolist()]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 0, 1]]
    # row 0: prompt at packed 0..1, responses at 2..3 -> predicted from 1..2; row 1: 5 from 4
    assert packed.logit_positions.tolist() == [1, 2, 4]
    assert packed.labels.tolist() == [ids[0, 3], ids[0, 4], ids[1, 3]]
    assert packed.response_valid.tolist() == [[True, True, False], [True, False, False]]


def test_pack_rejects_bad_rows() -> None:
    batch = make_batch([2, 0], [2, 1], p=3, t=3)
    with pytest.raises(ValueError, match="sample 1: it has no prompt token"):
        pack(batch)
    batch = make_batch([2, 2], [2, 1], p=3, t=3)
    batch["position_ids"] = batch["position_ids"] + torch.tensor([[0], [1]])
    with pytest.raises(ValueError, match="sample 1: its position_ids"):
        pack(batch)
    batch = make_batch([2, 2], [2, 1], p=3, t=3)
    batch["attention_mask"][0, 3] = 0  # a hole inside the response
    with pytest.raises(ValueError, match="sample 0: attention_mask is not a left-padded"):
        pack(batch)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_log_probs_and_entropy_equal_padded(attn: str) -> None:
    model = tiny_lm_with_attn(attn=attn).eval()
    batch = make_batch()
    valid = batch["attention_mask"][:, -5:].bool()
    with torch.no_grad():
        want_lp, want_ent = policy_forward(model, batch, 0.7, with_entropy=True)
        got_lp, got_ent = packed_policy_forward(model, batch, 0.7, with_entropy=True)
    assert got_lp.shape == got_ent.shape == (6, 5)
    torch.testing.assert_close(got_lp[valid], want_lp[valid], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_ent[valid], want_ent[valid], atol=1e-5, rtol=1e-5)
    assert (got_lp[~valid] == 0).all() and (got_ent[~valid] == 0).all()


def test_packed_values_equal_padded() -> None:
    critic = tiny_critic().eval()
    batch = make_batch()
    valid = batch["attention_mask"][:, -5:].bool()
    with torch.no_grad():
        want = value_forward(critic, batch)
        got = packed_value_forward(critic, batch)
    assert want[valid].abs().max() > 0.01
    torch.testing.assert_close(got[valid], want[valid], atol=1e-5, rtol=1e-5)


def test_token_budget_groups_cover_rows_and_fit() -> None:
    batch = make_batch()
    p, r = sequence_lengths(batch)
    assert p.tolist() == PROMPTS and r.tolist() == RESPONSES
    for packed in (False, True):
        groups = micro_batch_indices(
            batch, 2, use_dynamic_bsz=True, max_token_len=12, packed=packed
        )
        rows = torch.cat(groups).sort().values
        assert rows.tolist() == list(range(6))
        for g in groups:
            if packed:
                cost = int((p[g] + r[g]).sum())
            else:
                cost = len(g) * (int(p[g].max()) + max(int(r[g].max()), 1))
            assert cost <= 12
    # packed: lengths 11, 3, 7, 9, 3, 3 -> first-fit decreasing bins {11}, {9, 3}, {7, 3}, {3}
    groups = micro_batch_indices(batch, 2, use_dynamic_bsz=True, max_token_len=12, packed=True)
    assert [g.tolist() for g in groups] == [[0], [1, 3], [2, 4], [5]]
    assert [g.tolist() for g in micro_batch_indices(batch, 4)] == [[0, 1, 2, 3], [4, 5]]
    with pytest.raises(ValueError, match="sample 0 alone needs 11 tokens"):
        micro_batch_indices(batch, 2, use_dynamic_bsz=True, max_token_len=10, packed=True)
    parts = [torch.tensor([[30.0], [10.0]]), torch.tensor([[20.0]])]
    restored = restore_order(parts, [torch.tensor([2, 0]), torch.tensor([1])])
    assert restored.flatten().tolist() == [10.0, 20.0, 30.0]


SETTINGS = [
    {"use_dynamic_bsz": True, "max_token_len_per_device": 14},
    {"use_remove_padding": True},
    {"use_remove_padding": True, "use_dynamic_bsz": True, "max_token_len_per_device": 14},
]


@pytest.mark.parametrize("setting", SETTINGS)
def test_compute_log_prob_and_values_equal_fixed_padded(setting: dict) -> None:
    model = tiny_lm_with_attn()
    batch = make_batch()
    fixed = ActorWorker(
        model, ActorConfig(log_prob_micro_batch_size=4, autocast="none"), trainable=False
    )
    other = ActorWorker(
        model, ActorConfig(log_prob_micro_batch_size=4, autocast="none", **setting), trainable=False
    )
    want_lp, want_ent = fixed.compute_log_prob(batch, 0.9)
    got_lp, got_ent = other.compute_log_prob(batch, 0.9)
    torch.testing.assert_close(got_lp, want_lp, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_ent, want_ent, atol=1e-5, rtol=1e-5)
    critic = tiny_critic()
    want_v = CriticWorker(critic, CriticConfig(), micro_batch_size=4).compute_values(batch)
    got_v = CriticWorker(critic, CriticConfig(**setting), micro_batch_size=4).compute_values(batch)
    torch.testing.assert_close(got_v, want_v, atol=1e-5, rtol=1e-5)


def actor_batch(model) -> Batch:
    batch = make_batch(seed=3)
    worker = ActorWorker(model, ActorConfig(), trainable=False)
    batch["old_log_probs"], _ = worker.compute_log_prob(batch, 1.0, with_entropy=False)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, 1.0])[:, None]
    batch["advantages"] = adv * batch["response_mask"]
    batch["ref_log_prob"] = batch["old_log_probs"] - 0.1
    return batch


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum-norm"])
def test_update_gradients_equal_fixed_padded(mode: str) -> None:
    base = tiny_lm_with_attn()
    batch = actor_batch(base)
    grads: list[torch.Tensor] = []
    results = []
    for setting in [{}, *SETTINGS]:
        model = copy.deepcopy(base)
        cfg = ActorConfig(
            optim=OptimConfig(lr=1e-2), ppo_mini_batch_size=6, ppo_micro_batch_size=2,
            loss_agg_mode=mode, use_kl_loss=True, entropy_coeff=0.01, shuffle=False,
            autocast="none", **setting,
        )  # fmt: skip
        worker = ActorWorker(model, cfg)
        spy_grads(worker, model, grads)
        results.append(worker.update_policy(batch, temperature=1.0, n_per_prompt=1))
    assert grads[0].abs().max() > 0
    for got, metrics in zip(grads[1:], results[1:], strict=True):
        torch.testing.assert_close(got, grads[0], atol=1e-6, rtol=1e-5)
        for key in ("actor/pg_loss", "actor/entropy", "actor/kl_loss"):
            assert metrics[key] == pytest.approx(results[0][key], abs=1e-6)


def test_critic_update_gradients_equal_fixed_padded() -> None:
    base = tiny_critic()
    batch = make_batch(seed=4)
    batch["values"] = CriticWorker(base, CriticConfig()).compute_values(batch)
    batch["returns"] = batch["values"] + torch.linspace(-1, 1, 5)
    grads: list[torch.Tensor] = []
    for setting in [{}, *SETTINGS]:
        model = copy.deepcopy(base)
        cfg = CriticConfig(ppo_mini_batch_size=6, ppo_micro_batch_size=2, **setting)
        worker = CriticWorker(model, cfg)
        spy_grads(worker, model, grads)
        worker.generator.manual_seed(0)
        worker.update_critic(batch, n_per_prompt=1)
    assert grads[0].abs().max() > 0
    for got in grads[1:]:
        torch.testing.assert_close(got, grads[0], atol=1e-6, rtol=1e-5)


def test_min_micro_batches_splits_groups_within_budget() -> None:
    batch = make_batch()
    for packed in (False, True):
        groups = micro_batch_indices(
            batch, 2, use_dynamic_bsz=True, max_token_len=64, packed=packed, min_micro_batches=4
        )
        assert len(groups) == 4
        assert torch.cat(groups).sort().values.tolist() == list(range(6))
    with pytest.raises(ValueError, match="cannot make 7 micro-batches from 6 samples"):
        micro_batch_indices(batch, 2, use_dynamic_bsz=True, min_micro_batches=7)


def _rank_counts(rank: int, port: int, out: str) -> None:
    from creditrl.workers.distributed import destroy_process_group, init_process_group
    from creditrl.workers.micro_batches import micro_batches_for

    init_process_group(rank, 2, master_port=port, timeout_s=30)
    try:
        cfg = ActorConfig(use_dynamic_bsz=True, max_token_len_per_device=64)
        # rank 0: 6 x 11 padded tokens > 64 -> 2 micro-batches; rank 1: 6 x 3 -> 1 alone
        batch = make_batch() if rank == 0 else make_batch([1] * 6, [2] * 6)
        groups = micro_batches_for(batch, 2, cfg)
        with open(f"{out}.{rank}", "w") as f:
            json.dump([g.tolist() for g in groups], f)
    finally:
        destroy_process_group()


def test_dynamic_micro_batch_count_is_the_same_on_every_rank(tmp_path) -> None:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / "groups")
    mp.start_processes(_rank_counts, args=(port, out), nprocs=2, start_method="fork")
    small = make_batch([1] * 6, [2] * 6)
    assert len(micro_batch_indices(small, 2, use_dynamic_bsz=True, max_token_len=64)) == 1
    assert len(micro_batch_indices(make_batch(), 2, use_dynamic_bsz=True, max_token_len=64)) == 2
    groups = []
    for r in (0, 1):
        with open(f"{out}.{r}") as f:
            groups.append(json.load(f))
    assert [len(g) for g in groups] == [2, 2]
    assert sorted(i for g in groups[1] for i in g) == list(range(6))


def test_null_settings_pack_by_token_budget_on_cuda_only() -> None:
    """use_dynamic_bsz / use_remove_padding left null: on for CUDA batches, off on the CPU
    (fixed micro-batches, the CPU's figures unchanged); the auto budget takes the longest
    sample alone instead of refusing it."""
    assert ActorConfig().use_dynamic_bsz is None and CriticConfig().use_remove_padding is None
    assert [resolve_on_cuda(None, d) for d in ("cuda", "cpu")] == [True, False]
    assert [resolve_on_cuda(s, "cuda") for s in (False, True)] == [False, True]
    batch = make_batch()
    fixed = micro_batches_for(batch, 4, ActorConfig(max_token_len_per_device=10))
    assert [g.tolist() for g in fixed] == [[0, 1, 2, 3], [4, 5]]
    grown = micro_batch_indices(
        batch, 2, use_dynamic_bsz=True, max_token_len=10, packed=True, fit_longest=True
    )
    assert [g.tolist() for g in grown] == [[0], [3], [1, 2], [4, 5]]  # 11 | 9 | 3+7 | 3+3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device visible")
def test_default_actor_on_cuda_packs_by_token_budget() -> None:
    """On CUDA the default actor config runs packed micro-batches by token budget: its
    log-probs equal the padded fixed-size path's (float32)."""
    from creditrl.workers.placement import Placement

    batch = make_batch()
    cuda = Placement(device=torch.device("cuda"), backend="nccl", autocast="none")
    outs = {}
    for name, cfg in (
        ("default", ActorConfig(max_token_len_per_device=12)),
        ("padded", ActorConfig(use_dynamic_bsz=False, use_remove_padding=False)),
    ):
        worker = ActorWorker(tiny_lm_with_attn().cuda(), cfg, placement=cuda)
        on_device = batch.to("cuda")
        groups = micro_batches_for(on_device, 2, worker.cfg)
        outs[name] = (worker.compute_log_prob(on_device, 1.0, False)[0].cpu(), len(groups))
    assert outs["default"][1] == 4 and outs["padded"][1] == 3
    valid = batch["response_mask"].bool()
    torch.testing.assert_close(
        outs["default"][0][valid], outs["padded"][0][valid], atol=1e-5, rtol=1e-5
    )
