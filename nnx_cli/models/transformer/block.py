"""A pre-norm Transformer block: `h + attention(norm(h))`, then `h + mlp(norm(h))`, rematerialised on request.

Other layouts (sandwich norms, parallel attention and MLP) and the choice
between an MLP and a mixture of experts belong here.
"""

from __future__ import annotations

from typing import Any

import jax

import nnx
from nnx_cli.models.transformer.attention import Attention
from nnx_cli.models.transformer.dense import constrain
from nnx_cli.models.transformer.mlp import MLP
from nnx_cli.models.transformer.norms import make_norm
from nnx_cli.models.transformer.options import Architecture

_REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block in the backward pass
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # keep weight matmuls, recompute attention
}


class Block(nnx.Module):
    """A pre-norm Transformer block: `h + attention(norm(h))`, then `h + mlp(norm(h))`.

    Methods take `(h, _, positions)` and return `(h, None)`, the shape
    `nnx.Scan` threads through stacked layers (`_`: the unused scanned input).
    """

    def __init__(self, arch: Architecture, *, ctx: nnx.Context):
        self.attention_norm = make_norm(arch, ctx)
        self.attention = Attention(arch, ctx=ctx)
        self.mlp_norm = make_norm(arch, ctx)
        self.mlp = MLP(arch, ctx=ctx)
        self.remat = arch.remat
        self.scanned = arch.scanned

    def _forward(
        self,
        h: jax.Array,
        positions: jax.Array,
        segments: jax.Array | None,
        *,
        deterministic: bool,
        ctx: nnx.Context | None,
    ) -> jax.Array:
        h = h + self.attention(self.attention_norm(h), positions, segments, deterministic=deterministic, ctx=ctx)
        h = h + self.mlp(self.mlp_norm(h), deterministic=deterministic, ctx=ctx)
        return constrain(h, ("batch", "length", "embed"))

    def __call__(
        self,
        h: jax.Array,
        _: Any,
        positions: jax.Array,
        segments: jax.Array | None = None,
        *,
        deterministic: bool,
        ctx: nnx.Context | None = None,
    ) -> tuple[jax.Array, None]:
        forward = type(self)._forward
        if self.remat != "none":
            # Under lax.scan, CSE cannot undo rematerialisation, and preventing it costs speed.
            forward = nnx.remat(forward, policy=_REMAT_POLICIES[self.remat], prevent_cse=not self.scanned)
        return forward(self, h, positions, segments, deterministic=deterministic, ctx=ctx), None

    def prefill(self, h: jax.Array, _: Any, positions: jax.Array) -> tuple[jax.Array, None]:
        h = h + self.attention.prefill(self.attention_norm(h), positions)
        return h + self.mlp(self.mlp_norm(h), deterministic=True), None

    def decode(self, h: jax.Array, _: Any, positions: jax.Array) -> tuple[jax.Array, None]:
        h = h + self.attention.decode(self.attention_norm(h), positions)
        return h + self.mlp(self.mlp_norm(h), deterministic=True), None
