"""Shared-prefix forward (``actor.shared_prefix``): each distinct token prefix of a micro-batch
is computed once, with gradients.

GRPO samples n responses per prompt, and prompts often share a long head (system prompt,
worked example), so most of a micro-batch's tokens repeat. The rows' real tokens
(``packing.pack``) are merged into a token trie and run as one sequence
(``models.token_tree``). Response token j of row i reads its logits at the node of the prefix
before it (the row's path node at depth p_i + j - 1), so log-probs, entropies and, through
autograd (a shared node's gradient is the sum over the rows that read it), the gradients equal
the padded forward's up to float rounding (``tests/test_prefix_tree.py`` pins both). Where
the trie does not pay (``token_tree.tree_pays``) the caller's own forward runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import torch

from creditrl.batch import Batch
from creditrl.models.token_tree import (
    token_trie,
    tree_attention_mask,
    tree_pays,
    tree_unsupported,
)
from creditrl.workers.forward import DEFAULT_LOGITS_CHUNK_TOKENS, kept_of, output_rows
from creditrl.workers.packing import pack, response_outputs

__all__ = [
    "SHARED_PREFIX_CHOICES",
    "PrefixTree",
    "build_prefix_tree",
    "group_by_prompt",
    "prefix_tree_policy_forward",
    "resolve_shared_prefix",
]

SHARED_PREFIX_CHOICES = ("auto", "always", "never")


@dataclass
class PrefixTree:
    """The trie of one micro-batch and the map from its nodes back to the response layout."""

    input_ids: torch.Tensor  # (1, N) each node's token
    position_ids: torch.Tensor  # (1, N) each node's depth
    ancestors: torch.Tensor  # (N, N) bool: [a, b] iff b is a or an ancestor of a
    logit_nodes: torch.Tensor  # (K,) distinct nodes whose output predicts a response token
    logit_index: torch.Tensor  # (M,) for each real response token, its row in logit_nodes
    labels: torch.Tensor  # (M,) those response tokens, row by row
    response_valid: torch.Tensor  # (B, T) bool, True on the M real response columns
    tokens: int  # real tokens of the micro-batch (N of them are computed)

    @property
    def nodes(self) -> int:
        return self.input_ids.shape[1]


def build_prefix_tree(batch: Batch, only_if_it_pays: bool = False) -> PrefixTree | None:
    """The token trie of ``batch``'s rows (validated as ``packing.pack`` does); None, before
    the mask is built, when ``only_if_it_pays`` and the trie would not (``tree_pays``)."""
    packed = pack(batch)
    lengths = batch["attention_mask"].bool().sum(-1).tolist()
    flat = packed.input_ids[0].tolist()
    starts = [0, *accumulate(lengths)][:-1]
    trie = token_trie(flat[s : s + n] for s, n in zip(starts, lengths, strict=True))
    if only_if_it_pays and not tree_pays(trie.nodes, len(flat)):
        return None
    device = packed.input_ids.device
    # packed position -> node; logit_positions are packed positions of the prefix's last token
    node_of = torch.tensor([node for path in trie.paths for node in path], device=device)
    logit_nodes, logit_index = torch.unique(
        node_of[packed.logit_positions], sorted=True, return_inverse=True
    )
    return PrefixTree(
        input_ids=torch.tensor([trie.tokens], dtype=packed.input_ids.dtype, device=device),
        position_ids=torch.tensor([trie.depths], dtype=packed.position_ids.dtype, device=device),
        ancestors=trie.ancestors(device),
        logit_nodes=logit_nodes,
        logit_index=logit_index,
        labels=packed.labels,
        response_valid=packed.response_valid,
        tokens=len(flat),
    )


def prefix_tree_policy_forward(
    model: torch.nn.Module,
    batch: Batch,
    temperature: float = 1.0,
    with_entropy: bool = False,
    entropy_grad: bool = True,
    *,
    fallback: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
    chunk_tokens: int = DEFAULT_LOGITS_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``policy_forward`` over the micro-batch's prefix tree: log pi(y_t | s_t) (B, T) and the
    entropy (B, T) when asked (no gradient when ``entropy_grad`` is False); 0 on padding
    columns. Runs ``fallback`` (same first five arguments) where the tree does not pay."""
    tree = build_prefix_tree(batch, only_if_it_pays=True)
    if tree is None:
        return fallback(model, batch, temperature, with_entropy, entropy_grad)
    mask = tree_attention_mask(
        tree.ancestors, model.config._attn_implementation, next(model.parameters()).dtype
    )
    rows, head = output_rows(
        model,
        tree.logit_nodes,
        input_ids=tree.input_ids,
        attention_mask=mask,
        position_ids=tree.position_ids,
    )
    return response_outputs(
        rows[0][tree.logit_index],
        tree,
        temperature,
        with_entropy,
        entropy_grad,
        labels=tree.labels,
        head=head,
        chunk_tokens=chunk_tokens,
        kept=kept_of(batch, tree.response_valid),
    )


def group_by_prompt(batch: Batch) -> torch.Tensor:
    """Row order that puts rows with the same prompt tokens next to each other (stable), so
    fixed-size micro-batches share whole prompts; which rows share a micro-batch changes no
    result (``micro_batches``)."""
    prompt_len = batch["attention_mask"].shape[1] - batch["responses"].shape[1]
    prompts = batch["input_ids"][:, :prompt_len] * batch["attention_mask"][:, :prompt_len]
    _, group = torch.unique(prompts, dim=0, return_inverse=True)
    first_row = torch.full((int(group.max()) + 1,), len(group), dtype=torch.long)
    first_row.scatter_reduce_(0, group, torch.arange(len(group)), reduce="amin")
    return torch.argsort(first_row[group] * len(group) + torch.arange(len(group)))


def resolve_shared_prefix(setting: str, model: torch.nn.Module, device: str = "cpu") -> bool:
    """Whether the actor uses the tree forward: 'always' (ValueError if the model cannot),
    'never', or 'auto': for CPU models that can (measured faster there: benchmarks/step_time.py;
    unmeasured on GPUs, where the dense mask also rules out flash-attention kernels).
    ``device``: the type of the device the model runs on ('cpu', 'cuda')."""
    if setting not in SHARED_PREFIX_CHOICES:
        raise ValueError(
            f"actor.shared_prefix must be one of {SHARED_PREFIX_CHOICES}, got {setting!r}"
        )
    if setting == "never":
        return False
    reason = tree_unsupported(model)
    if setting == "always":
        if reason is not None:
            raise ValueError(f"actor.shared_prefix=always cannot be used: {reason}")
        return True
    return reason is None and device == "cpu"
