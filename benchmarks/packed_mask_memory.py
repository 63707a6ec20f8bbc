"""The attention mask transformers builds for one packed micro-batch (``workers.packing``):
its bytes for N packed tokens, and what sdpa keeps of it for the backward of every layer.

Run: ``python benchmarks/packed_mask_memory.py [--tokens 2048,8192,16384] [--rows-of 512]``

A packed row of N tokens (sequences of ``--rows-of`` tokens each, ``position_ids`` restarting
at 0) goes through ``transformers.masking_utils.create_causal_mask`` as the model's forward
builds it (sdpa, ``attention_mask=None``); the mask is one (1, 1, N, N) tensor shared by the
layers, and each layer's sdpa call keeps a reference for its backward, so its bytes stay
allocated until the backward is done. Printed per N: the mask's shape, dtype and MiB.
"""

from __future__ import annotations

import argparse

import torch
from transformers import LlamaConfig
from transformers.masking_utils import create_causal_mask


def packed_mask(tokens: int, rows_of: int) -> torch.Tensor | None:
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2)
    config._attn_implementation = "sdpa"
    positions = (torch.arange(tokens) % rows_of)[None]
    embeds = torch.zeros(1, tokens, 8)
    return create_causal_mask(
        config=config, inputs_embeds=embeds, attention_mask=None, cache=None,
        position_ids=positions,
    )  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="2048,8192,16384")
    parser.add_argument("--rows-of", type=int, default=512)
    args = parser.parse_args()
    print("| packed tokens N | mask | dtype | MiB |")
    print("|---|---|---|---|")
    for tokens in (int(t) for t in args.tokens.split(",")):
        mask = packed_mask(tokens, args.rows_of)
        if mask is None:
            print(f"| {tokens:,} | none | - | 0 |")
            continue
        mib = mask.numel() * mask.element_size() / 2**20
        print(f"| {tokens:,} | {tuple(mask.shape)} | {mask.dtype} | {mib:,.0f} |")


if __name__ == "__main__":
    main()
