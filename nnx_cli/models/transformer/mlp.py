"""The feed-forward half of a block: GPT-2's GELU MLP, Llama's SwiGLU or Gemma's GeGLU, `mlp_dim` wide.

A mixture of experts goes beside it (`moe.py`), chosen by `Block` from the
architecture.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

import nnx
from nnx_cli.models.transformer.dense import Dense, constrain
from nnx_cli.models.transformer.options import GATED, Architecture


def activation(x: jax.Array, kind: str) -> jax.Array:
    """silu (`kind` swiglu) or the tanh GELU of `x`, computed in float32 and rounded once to `x`'s dtype, as
    PyTorch computes a 16-bit activation. Written in bfloat16, XLA's CPU rounded after every operation of the
    formula (the sigmoid's negation, exponential, sum and quotient): 5.1 ms for `silu(gate) * up` at 1,024 x
    4,864, 2.8 ms so, and one rounding instead of five. A GPU keeps such a formula in float32 anyway."""
    wide = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    return (nnx.silu(wide) if kind == "swiglu" else nnx.gelu(wide)).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def gated(gate: jax.Array, up: jax.Array, kind: str) -> jax.Array:
    """`act(gate) * up` with `act` silu (`kind` swiglu) or the tanh GELU (geglu), whose backward pass keeps `gate`
    and `up` only and recomputes the activation's derivative: autodiff kept five `[tokens, mlp_dim]` arrays per
    layer (the sigmoid or tanh, the activation, their product's factors). The activation is :func:`activation`'s,
    the backward pass computed in float32 too."""
    return activation(gate, kind) * up


def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """`silu(gate) * up` (Llama's), with :func:`gated`'s backward pass."""
    return gated(gate, up, "swiglu")


def geglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """`gelu(gate) * up`, the tanh GELU (Gemma's), with :func:`gated`'s backward pass."""
    return gated(gate, up, "geglu")


_GELU_C = math.sqrt(2 / math.pi)  # gelu(x) = x / 2 (1 + tanh(c (x + 0.044715 x^3)))


def _gated_forward(gate: jax.Array, up: jax.Array, kind: str) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return gated(gate, up, kind), (gate, up)


def _gated_backward(kind: str, saved: tuple[jax.Array, jax.Array], g: jax.Array) -> tuple[jax.Array, jax.Array]:
    gate_dtype, up_dtype = saved[0].dtype, saved[1].dtype
    wide = jnp.promote_types(jnp.result_type(*saved, g), jnp.float32)
    gate, up, g = (a.astype(wide) for a in (*saved, g))
    if kind == "swiglu":
        sigmoid = jax.nn.sigmoid(gate)
        act = gate * sigmoid
        # d silu(x) / dx = sigmoid(x) (1 + x (1 - sigmoid(x)))
        d_act = sigmoid * (1 + gate * (1 - sigmoid))
    else:
        tanh = jnp.tanh(_GELU_C * (gate + 0.044715 * gate**3))
        act = 0.5 * gate * (1 + tanh)
        # d gelu(x) / dx = (1 + t) / 2 + x / 2 (1 - t^2) c (1 + 3 * 0.044715 x^2)
        d_act = 0.5 * (1 + tanh) + 0.5 * gate * (1 - tanh * tanh) * _GELU_C * (1 + 3 * 0.044715 * gate * gate)
    return (g * up * d_act).astype(gate_dtype), (g * act).astype(up_dtype)


gated.defvjp(_gated_forward, _gated_backward)


class MLP(nnx.Module):
    """`proj(gelu(fc(x)))` (GELU, tanh approximation, as GPT-2), or with `mlp: swiglu` `proj(silu(gate(x)) * fc(x))`
    (Llama's gate, up and down projections), or with `mlp: geglu` `proj(gelu(gate(x)) * fc(x))` (Gemma's, the tanh
    GELU), then dropout; hidden width `mlp_dim`."""

    def __init__(self, arch: Architecture, *, ctx: nnx.Context):
        embed, hidden = arch.embed_dim, arch.mlp_dim
        dense = dict(dtype=arch.dtype, use_bias=arch.bias, ctx=ctx)
        self.fc = Dense((embed,), (hidden,), ("embed",), ("mlp",), std=0.02, lora=arch.adapter("up"),
                        quantize=arch.quantized("up"), **dense)  # fmt: skip
        self.proj = Dense((hidden,), (embed,), ("mlp",), ("embed",), std=arch.out_std, lora=arch.adapter("down"),
                          quantize=arch.quantized("down"), **dense)  # fmt: skip
        if arch.mlp in GATED:
            self.gate = Dense((embed,), (hidden,), ("embed",), ("mlp",), std=0.02, lora=arch.adapter("gate"),
                              quantize=arch.quantized("gate"), **dense)  # fmt: skip
        self.gated = arch.mlp in GATED
        self.kind = arch.mlp
        self.dropout = nnx.Dropout(arch.dropout)

    def __call__(self, x: jax.Array, *, deterministic: bool, ctx: nnx.Context | None = None) -> jax.Array:
        train = dict(deterministic=deterministic, ctx=ctx)
        return self.down(self.up(x, **train), x.shape[:2], **train)

    def up(
        self, x: jax.Array, *, deterministic: bool, ctx: nnx.Context | None = None
    ) -> tuple[jax.Array | None, jax.Array]:
        """The gate (None without one) and up projections of `x` `[batch, length, embed]`, as `[tokens, mlp_dim]`:
        what :meth:`down` takes (`Block` computes them apart, so that the norm before them is recomputed for the
        backward pass instead of kept)."""
        train = dict(deterministic=deterministic, ctx=ctx)
        batch, length = x.shape[:2]
        tokens = x.reshape(batch * length, -1)  # one operand for the up and gate projections, one saved copy
        up = self.fc(tokens, **train)
        return (self.gate(tokens, **train) if self.gated else None), up

    def down(
        self,
        projected: tuple[jax.Array | None, jax.Array],
        shape: tuple[int, int],
        *,
        deterministic: bool,
        ctx: nnx.Context | None = None,
    ) -> jax.Array:
        """The rest of the MLP from :meth:`up`'s `projected` for an input of `shape` `(batch, length)`: the
        activation, the down projection and dropout."""
        train = dict(deterministic=deterministic, ctx=ctx)
        (gate, up), (batch, length) = projected, shape
        down = MLP._down
        if not deterministic:  # training: the activation is recomputed for the backward pass, not kept
            down = nnx.remat(down, policy=jax.checkpoint_policies.nothing_saveable, prevent_cse=False,
                             static_argnums=(2, 3))  # fmt: skip
        return self.dropout(down(self, gate, up, batch, length, **train), deterministic=deterministic, ctx=ctx)

    def _down(
        self, gate: jax.Array | None, up: jax.Array, batch: int, length: int, *, deterministic: bool, ctx=None
    ) -> jax.Array:
        """`proj(act(gate) * up)` or `proj(gelu(up))`. Under training it runs rematerialised: the backward pass
        needs the activation `[tokens, mlp_dim]` only for the down projection's own gradients (its kernel's, or its
        adapter's), and remaking it from `gate` and `up`, which are kept anyway, is one element-wise pass, where
        keeping it held another `[tokens, mlp_dim]` array per layer from the forward pass to the backward (on
        Qwen2.5-0.5B's shape at 1,024 tokens, 9.5 MB a layer; the peak of a LoRA step fell by 420-660 MB). The
        projection's own product is not redone: nothing in the backward pass needs its output."""
        h = gated(gate, up, self.kind) if self.gated else activation(up, "gelu")
        h = constrain(h.reshape(batch, length, -1), ("batch", "length", "mlp"))
        return self.proj(h, deterministic=deterministic, ctx=ctx)
