"""A decode step for plain Llama models on CPU, without transformers' per-layer plumbing.

Transformers' forward spends a fifth of a small-batch CPU decode step on small ops and Python
around the matrix products (RMSNorm, rotary, mask building, cache and output bookkeeping).
``LlamaDecoder.step`` computes the same function with fused ``rms_norm``, one product for
q/k/v, an additive mask built once a step, rotary cos/sin read from a table computed once (q
and k rotated together) and the weight-major product of ``cpu_kernels``, whose (out, m) result
is already the down projection's x^T after gate and up. Its logits equal
transformers' to float rounding (``tests/test_rollout.py`` pins samples and log-probs). It
writes into the engine's ``PreallocatedLayer`` cache, so prefill, row removal and the agent's
kept KV are unchanged. The query is made contiguous before attention (a row-strided one sends
SDPA to its slower math kernel); the LM head runs in blocks of ``HEAD_CHUNK_ROWS`` weight rows
and returns row-major logits. The figures behind each choice, and the command that gives
them: ``benchmarks/results/rollout_kernels.md``.

The concatenated q/k/v weights are built with the decoder, once per ``generate`` call: the
actor's weights change between calls, and a fused AdamW step changes them without moving
their version counters, so no cheaper check would see it (``tests/test_llama_decode.py``).
Gate and up are two products: concatenating their weights (three quarters of the copy) cost
more per call than the one product saved a step. A LoRA actor is decoded from its merged copy
(``rollout.merged_copy``), refreshed before the decoder is built, so the same holds for it.

Used only where it is exactly the model's function: ``type(model) is LlamaForCausalLM`` (a
subclass may change ``forward``), float32 on CPU, sdpa or eager attention, SiLU MLP, no
biases, one tensor-parallel slice, default head dimension. Anything else decodes through the
model's own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

from creditrl.rollout.cpu_kernels import WEIGHT_MAJOR_ROWS, weight_major_product

__all__ = ["LlamaDecoder"]

HEAD_CHUNK_ROWS = 2048  # LM-head weight rows per product (0: one product)
# rotary types whose values depend on the position only (a table is computed once)
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")


def _project_head(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``x @ weight^T`` (m, V), row-major: ``weight_major_product`` in blocks of
    ``HEAD_CHUNK_ROWS`` weight rows written into one (V, m) output, then transposed once (the
    sampler reads row-strided logits ~4x slower than the copy costs)."""
    if not HEAD_CHUNK_ROWS or x.shape[0] > WEIGHT_MAJOR_ROWS:
        return weight_major_product(weight, x).contiguous()
    out = x.new_empty((weight.shape[0], x.shape[0]))
    for block, rows in zip(weight.split(HEAD_CHUNK_ROWS), out.split(HEAD_CHUNK_ROWS), strict=True):
        torch.mm(block, x.t(), out=rows)
    return out.t().contiguous()


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` (transformers' rotary embedding, the same values) for
    ``x`` (m, heads, dim) and ``cos``/``signed_sin`` (m, 1, dim), ``signed_sin`` the sine with
    its first half negated: ``rotate_half(x) * sin == cat(x2, x1) * signed_sin`` exactly."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return swapped.mul_(signed_sin).add_(x * cos)


class LlamaDecoder:
    """One-token decode steps of a plain ``LlamaForCausalLM`` (see the module docstring)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        config, inner = model.config, model.model
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.head = model.lm_head.weight
        self.rotary = inner.rotary_emb
        rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type")
        self.static_rope = rope in _STATIC_ROPE
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # built at the first step
        self.layers = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                (
                    layer.input_layernorm.weight,
                    torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                    attn.o_proj.weight,
                    layer.post_attention_layernorm.weight,
                    mlp.gate_proj.weight,
                    mlp.up_proj.weight,
                    mlp.down_proj.weight,
                )
            )

    @classmethod
    def for_model(cls, model: torch.nn.Module) -> LlamaDecoder | None:
        """A decoder for ``model`` when it is a plain float32 CPU Llama, else None."""
        if type(model) is not LlamaForCausalLM:
            return None
        config = model.config
        weight = model.lm_head.weight
        default_head_dim = config.hidden_size // config.num_attention_heads
        plain = (
            weight.device.type == "cpu"
            and weight.dtype == torch.float32
            and config._attn_implementation in ("sdpa", "eager")
            and config.hidden_act == "silu"
            and not config.attention_bias
            and not config.mlp_bias
            and getattr(config, "pretraining_tp", 1) == 1
            and getattr(config, "head_dim", None) in (None, default_head_dim)
            and config.num_attention_heads % config.num_key_value_heads == 0
            and all(not hasattr(m, "_hf_hook") for m in model.modules())
        )
        return cls(model) if plain else None

    def _rotary_table(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and the signed sine (``_rotate``) of positions 0..``length`` - 1, (length, dim):
        the rotary module's own values, computed once."""
        positions = torch.arange(length, device=self.embed.device)[None]
        cos, sin = self.rotary(self.embed[:1], positions)
        half = sin.shape[-1] // 2
        return cos[0], torch.cat((-sin[0, :, :half], sin[0, :, half:]), dim=-1)

    def _rotation(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """cos and the signed sine (m, 1, dim) at ``positions`` (m,): read from the table of
        a static rotary embedding (twice the positions needed, rebuilt when one passes its
        end), else computed."""
        if not self.static_rope:
            cos, sin = self.rotary(x, positions[:, None])
            half = sin.shape[-1] // 2
            return cos, torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        if self._table is None or int(positions.max()) >= len(self._table[0]):
            self._table = self._rotary_table(2 * int(positions.max()) + 2)
        cos, signed_sin = self._table
        return cos[positions][:, None], signed_sin[positions][:, None]

    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        attention_mask: torch.Tensor,
        cache,
    ) -> torch.Tensor:
        """Next-token logits (m, V) for ``tokens`` (m, 1) at ``positions`` (m, 1), attending to
        the cached keys plus themselves under ``attention_mask`` (m, cached + 1) (1: real)."""
        rows, heads, kv_heads, dim = tokens.shape[0], self.heads, self.kv_heads, self.head_dim
        rotated, width = heads + kv_heads, self.embed.shape[1]
        x = F.embedding(tokens.view(rows), self.embed)
        cos, signed_sin = self._rotation(x, positions.view(rows))
        # additive, built once a step (a boolean mask is converted again in every layer)
        mask = torch.zeros(attention_mask.shape, dtype=x.dtype, device=x.device)
        mask = mask.masked_fill_(attention_mask == 0, float("-inf"))[:, None, None, :]
        for (norm_in, qkv, out, norm_post, gate, up, down), layer in zip(
            self.layers, cache.layers, strict=True
        ):
            # W @ x^T: (out, m); made row-major once for q, k and v (a query whose last
            # dimension is strided sends SDPA to its math kernel, ~1.4x slower here)
            projected = torch.mm(qkv, F.rms_norm(x, (width,), norm_in, self.eps).t())
            projected = projected.t().contiguous()
            q_and_k = projected[:, : rotated * dim].view(rows, rotated, dim)
            q_and_k = _rotate(q_and_k, cos, signed_sin)
            grouped = q_and_k[:, :heads].view(rows, kv_heads, heads // kv_heads, dim)
            v = projected[:, rotated * dim :].view(rows, kv_heads, 1, dim)
            keys, values = layer.update(q_and_k[:, heads:, None], v)
            attended = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)
            x = x + torch.mm(out, attended.view(rows, heads * dim).t()).t()
            normed = F.rms_norm(x, (width,), norm_post, self.eps).t()
            gated = F.silu(torch.mm(gate, normed), inplace=True)  # (intermediate, m): x^T
            x = x + torch.mm(down, gated.mul_(torch.mm(up, normed))).t()
        return _project_head(self.head, F.rms_norm(x, (width,), self.norm, self.eps))
