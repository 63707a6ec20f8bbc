"""A decode step for plain Llama models on CPU, without transformers' per-layer plumbing.

Transformers' forward spends a fifth of a small-batch CPU decode step on small ops and Python
around the matrix products (RMSNorm, rotary, mask building, cache and output bookkeeping).
``LlamaDecoder.step`` computes the same function with fused ``rms_norm``, one product for q/k/v
and one for gate/up (weights concatenated once per ``generate`` call, since the actor's
weights change between calls), an additive mask built once a step, and the weight-major
product of ``cpu_kernels``; its logits are within 5e-5 of transformers' (``tests/test_rollout.py``
pins samples and log-probs). It writes into the engine's ``PreallocatedLayer`` cache, so
prefill, row removal and the agent's kept KV are unchanged. The query is made contiguous
before attention (a row-strided one sends SDPA to its slower math kernel), and the LM head runs
in blocks of ``HEAD_CHUNK_ROWS`` weight rows. The figures behind each choice, and the command
that gives them: ``benchmarks/results/rollout_kernels.md``.

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


def _project_head(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``weight_major_product`` in blocks of ``HEAD_CHUNK_ROWS`` weight rows, written into one
    output."""
    if not HEAD_CHUNK_ROWS or x.shape[0] > WEIGHT_MAJOR_ROWS:
        return weight_major_product(weight, x)
    out = x.new_empty((weight.shape[0], x.shape[0]))
    for block, rows in zip(weight.split(HEAD_CHUNK_ROWS), out.split(HEAD_CHUNK_ROWS), strict=True):
        torch.mm(block, x.t(), out=rows)
    return out.t()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class LlamaDecoder:
    """One-token decode steps of a plain ``LlamaForCausalLM`` (see the module docstring)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        config = model.config
        self.model = model
        self.heads = config.num_attention_heads
        self.kv_heads = config.num_key_value_heads
        self.head_dim = config.hidden_size // self.heads
        self.eps = config.rms_norm_eps
        self.layers = []
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(
                (
                    layer.input_layernorm.weight,
                    torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
                    attn.o_proj.weight,
                    layer.post_attention_layernorm.weight,
                    torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
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

    def step(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        attention_mask: torch.Tensor,
        cache,
    ) -> torch.Tensor:
        """Next-token logits (m, V) for ``tokens`` (m, 1) at ``positions`` (m, 1), attending to
        the cached keys plus themselves under ``attention_mask`` (m, cached + 1) (1: real)."""
        inner = self.model.model
        rows, heads, kv_heads, dim = tokens.shape[0], self.heads, self.kv_heads, self.head_dim
        q_width, kv_width = heads * dim, kv_heads * dim
        x = inner.embed_tokens(tokens).view(rows, -1)
        cos, sin = inner.rotary_emb(x, positions)
        cos, sin = cos[:, None], sin[:, None]  # (m, 1, 1, dim)
        # additive, built once a step (a boolean mask is converted again in every layer)
        mask = torch.zeros(attention_mask.shape, dtype=x.dtype, device=x.device)
        mask = mask.masked_fill_(attention_mask == 0, float("-inf"))[:, None, None, :]
        for (norm_in, qkv, out, norm_post, gate_up, down), layer in zip(
            self.layers, cache.layers, strict=True
        ):
            # contiguous: the weight-major product is row-strided, and a query whose last
            # dimension is strided sends SDPA to its math kernel (~1.4x slower here)
            projected = weight_major_product(qkv, F.rms_norm(x, (x.shape[-1],), norm_in, self.eps))
            projected = projected.contiguous()
            q = projected[:, :q_width].reshape(rows, heads, 1, dim)
            k = projected[:, q_width : q_width + kv_width].reshape(rows, kv_heads, 1, dim)
            v = projected[:, q_width + kv_width :].reshape(rows, kv_heads, 1, dim)
            keys, values = layer.update(_rotate(k, cos, sin), v)
            grouped = _rotate(q, cos, sin).reshape(rows, kv_heads, heads // kv_heads, dim)
            attended = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask)
            x = x + weight_major_product(out, attended.reshape(rows, q_width))
            hidden = weight_major_product(
                gate_up, F.rms_norm(x, (x.shape[-1],), norm_post, self.eps)
            )
            half = hidden.shape[-1] // 2
            x = x + weight_major_product(down, F.silu(hidden[:, :half]) * hidden[:, half:])
        x = F.rms_norm(x, (x.shape[-1],), inner.norm.weight, self.eps)
        return _project_head(self.model.lm_head.weight, x)
