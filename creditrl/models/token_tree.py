"""Token tries run as one sequence: each distinct prefix of a set of token sequences once.

In a causal LM the output at a token depends only on the tokens up to it, so sequences that
agree on tokens 0..k have the same hidden states (and keys and values) there. ``token_trie``
merges sequences into a trie, one node per distinct prefix holding its last token, and a
model runs all nodes as one row with ``position_ids`` = each node's depth and the 4-D mask of
``tree_attention_mask``: node a attends to node b iff b is a or an ancestor of a, exactly the
causal context each token has in its own sequence. The actor's update uses it to compute each
shared prefix of a micro-batch once (``workers.prefix_tree``), the CPU rollout engine to
prefill the shared head of its prompts once (``rollout.hf_engine``).

The mask is dense (N x N for N nodes), so callers use a trie only where ``tree_pays``. The
model must pass ``position_ids`` and a 4-D mask through to its attention ('sdpa': boolean,
True = attend; 'eager': additive float) and attend to the full context in every layer (no
sliding window): ``tree_unsupported`` says why not otherwise.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

__all__ = [
    "MAX_NODES",
    "MIN_SAVING",
    "TokenTrie",
    "token_trie",
    "tree_attention_mask",
    "tree_pays",
    "tree_unsupported",
]

MAX_NODES = 4096  # the mask is MAX_NODES^2 booleans (16 MiB)
MIN_SAVING = 0.1  # use a trie when it removes at least this share of the tokens
_MASKED_KERNELS = ("sdpa", "eager")


@dataclass
class TokenTrie:
    """Nodes in creation order (a parent before its children) and each sequence's path."""

    tokens: list[int]  # each node's token
    depths: list[int]  # each node's depth: its position in every sequence through it
    paths: list[list[int]]  # per sequence, its node at each position

    @property
    def nodes(self) -> int:
        return len(self.tokens)

    def ancestors(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """(N, N) bool: [a, b] iff node b is node a or an ancestor of it."""
        n = self.nodes
        out = torch.zeros(n, n, dtype=torch.bool, device=device)
        for path in self.paths:
            ids = torch.tensor(path, device=device)
            rows, cols = torch.tril_indices(len(path), len(path), device=device)
            out[ids[rows], ids[cols]] = True
        return out


def token_trie(sequences: Iterable[Sequence[int]]) -> TokenTrie:
    """The trie of ``sequences`` (lists of token ids)."""
    children: dict[tuple[int, int], int] = {}
    tokens: list[int] = []
    depths: list[int] = []
    paths: list[list[int]] = []
    for sequence in sequences:
        parent, path = -1, []
        for depth, token in enumerate(sequence):
            node = children.get((parent, token))
            if node is None:
                node = children[(parent, token)] = len(tokens)
                tokens.append(token)
                depths.append(depth)
            path.append(node)
            parent = node
        paths.append(path)
    return TokenTrie(tokens=tokens, depths=depths, paths=paths)


def tree_pays(nodes: int, tokens: int) -> bool:
    """Whether running ``nodes`` trie nodes instead of ``tokens`` tokens is worth it."""
    return nodes <= MAX_NODES and nodes <= (1.0 - MIN_SAVING) * tokens


def tree_attention_mask(ancestors: torch.Tensor, kernel: str, dtype: torch.dtype) -> torch.Tensor:
    """(1, 1, N, N) mask of ``ancestors``: boolean for sdpa, additive (0 / dtype min) else."""
    mask = ancestors[None, None]
    if kernel == "sdpa":
        return mask
    additive = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return additive.masked_fill_(~mask, torch.finfo(dtype).min)


def tree_unsupported(model: torch.nn.Module) -> str | None:
    """None when ``model`` can run a trie as one sequence, else why not (one line)."""
    config = getattr(model, "config", None)
    if config is None:
        return "the model has no transformers config"
    kernel = getattr(config, "_attn_implementation", None)
    if kernel not in _MASKED_KERNELS:
        return f"its attention implementation {kernel!r} is not one of {_MASKED_KERNELS}"
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        sliding = getattr(config, "sliding_window", None) is not None
        layer_types = ["sliding_attention" if sliding else "full_attention"]
    if any(kind != "full_attention" for kind in layer_types):
        return "it has layers that do not attend to the full context (e.g. a sliding window)"
    return None
