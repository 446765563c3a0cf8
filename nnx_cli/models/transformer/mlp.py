"""The feed-forward half of a block: GPT-2's GELU MLP, Llama's SwiGLU or Gemma's GeGLU, `mlp_dim` wide.

A mixture of experts goes beside it (`moe.py`), chosen by `Block` from the
architecture.
"""

from __future__ import annotations

import jax

import nnx
from nnx_cli.models.transformer.dense import Dense, constrain
from nnx_cli.models.transformer.options import GATED, Architecture


class MLP(nnx.Module):
    """`proj(gelu(fc(x)))` (GELU, tanh approximation, as GPT-2), or with `mlp: swiglu` `proj(silu(gate(x)) * fc(x))`
    (Llama's gate, up and down projections), or with `mlp: geglu` `proj(gelu(gate(x)) * fc(x))` (Gemma's, the tanh
    GELU), then dropout; hidden width `mlp_dim`."""

    def __init__(self, arch: Architecture, *, ctx: nnx.Context):
        embed, hidden = arch.embed_dim, arch.mlp_dim
        dense = dict(dtype=arch.dtype, use_bias=arch.bias, ctx=ctx)
        self.fc = Dense((embed,), (hidden,), ("embed",), ("mlp",), std=0.02, lora=arch.adapter("up"), **dense)
        self.proj = Dense(
            (hidden,), (embed,), ("mlp",), ("embed",), std=arch.out_std, lora=arch.adapter("down"), **dense
        )
        if arch.mlp in GATED:
            self.gate = Dense((embed,), (hidden,), ("embed",), ("mlp",), std=0.02, lora=arch.adapter("gate"), **dense)
        self.gated = arch.mlp in GATED
        self.kind = arch.mlp
        self.dropout = nnx.Dropout(arch.dropout)

    def __call__(self, x: jax.Array, *, deterministic: bool, ctx: nnx.Context | None = None) -> jax.Array:
        train = dict(deterministic=deterministic, ctx=ctx)
        up = self.fc(x, **train)
        if self.gated:
            gate = self.gate(x, **train)
            h = (nnx.silu(gate) if self.kind == "swiglu" else nnx.gelu(gate)) * up
        else:
            h = nnx.gelu(up)
        h = constrain(h, ("batch", "length", "mlp"))
        return self.dropout(self.proj(h, **train), deterministic=deterministic, ctx=ctx)
