"""A Transformer block: `h + attention(norm(h))`, then `h + mlp(norm(h))`, rematerialised on request.

With `post_norms` (Gemma's sandwich) each half's output is normed again
before it joins the residual stream: `h + norm(attention(norm(h)))`. A
`sparse` block has a mixture of experts where another has its MLP. Other
layouts (parallel attention and MLP) belong here.
"""

from __future__ import annotations

from typing import Any

import jax

import nnx
from nnx_cli.models.transformer.attention import Attention, Layer
from nnx_cli.models.transformer.dense import PROJECTION, constrain
from nnx_cli.models.transformer.mlp import MLP
from nnx_cli.models.transformer.moe import MoE
from nnx_cli.models.transformer.norms import make_norm
from nnx_cli.models.transformer.options import Architecture
from nnx_cli.models.transformer.residuals import packed_call, packs

# keep the projections' outputs (tagged: most run in custom VJPs, where a policy of dots cannot see them)
_PROJECTIONS = jax.checkpoint_policies.save_only_these_names(PROJECTION)
_REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole block in the backward pass
    # keep the weight matmuls' results, recompute attention
    "dots": jax.checkpoint_policies.save_from_both_policies(
        jax.checkpoint_policies.dots_with_no_batch_dims_saveable, _PROJECTIONS
    ),
}


class Block(nnx.Module):
    """A pre-norm Transformer block: `h + attention(norm(h))`, then `h + mlp(norm(h))` (with `post_norms`,
    `h + norm(attention(norm(h)))` and `h + norm(mlp(norm(h)))`).

    Methods take `(h, layer, positions)` and return `(h, statistics)`, the
    shape `nnx.Scan` threads through stacked layers: `layer` is the scanned
    input, the block's index (traced when scanned, None when no layer
    differs; a Python int when unrolled), which attention looks its window
    and rotary base up by. `statistics` are a `sparse` block's router
    statistics in training (for the load-balancing loss; None otherwise).
    A `sparse` block has a mixture of experts, `moe`, where another has its
    `mlp`.
    """

    def __init__(self, arch: Architecture, *, sparse: bool = False, ctx: nnx.Context):
        self.attention_norm = make_norm(arch, ctx)
        self.attention = Attention(arch, ctx=ctx)
        self.mlp_norm = make_norm(arch, ctx)
        if sparse:
            self.moe = MoE(arch, ctx=ctx)
        else:
            self.mlp = MLP(arch, ctx=ctx)
        if arch.post_norms:
            self.post_attention_norm = make_norm(arch, ctx)
            self.post_mlp_norm = make_norm(arch, ctx)
        self.sparse = sparse
        self.post_norms = arch.post_norms
        self.remat = arch.remat
        self.scanned = arch.scanned

    def _residual(self, h: jax.Array, out: jax.Array, post: str) -> jax.Array:
        return h + (getattr(self, post)(out) if self.post_norms else out)

    def _feed_forward(
        self, h: jax.Array, segments: jax.Array | None = None, *, deterministic: bool, ctx: nnx.Context | None = None
    ) -> tuple[jax.Array, Any]:
        """The MLP of `mlp_norm(h)`, or the experts and their router statistics (over the tokens of real
        examples); the norm remade in training either way (:meth:`_normed`)."""
        train = dict(deterministic=deterministic, ctx=ctx)
        if not self.sparse:
            return self.mlp.down(self._normed(Block._mlp_projections, h, **train), h.shape[:2], **train), None
        routed = self._normed(Block._moe_projections, h, **train)
        return self.moe.down(routed, h.shape, None if segments is None else segments > 0, **train)

    def _forward(
        self,
        h: jax.Array,
        positions: jax.Array,
        segments: jax.Array | None,
        *,
        deterministic: bool,
        ctx: nnx.Context | None,
        layer: Layer,
    ) -> tuple[jax.Array, Any]:
        train = dict(deterministic=deterministic, ctx=ctx)
        projected = self._normed(Block._attention_projections, h, **train)
        h = self._residual(h, self.attention.attend(projected, positions, segments, layer=layer, **train),
                           "post_attention_norm")  # fmt: skip
        y, statistics = self._feed_forward(h, segments, **train)
        return constrain(self._residual(h, y, "post_mlp_norm"), ("batch", "length", "embed")), statistics

    def _normed(self, projections: Any, h: jax.Array, *, deterministic: bool, ctx: nnx.Context | None) -> Any:
        """`projections(self, h)`: a norm and the projections that read it. In training without `remat` they
        run rematerialised, keeping the projections' outputs (tagged `projection`) and recomputing the rest: the
        backward pass keeps the norm's input `h` and remakes its output (one element-wise pass) where it kept
        both, the output for the projections' gradients and the input for the norm's. That is two `[tokens,
        embed]` arrays a layer: a SmolLM2-135M LoRA step's temporaries fell from 913 to 767 MiB in float32. The
        projections' products are not redone (nothing in the backward pass reads their outputs here); an
        adapter's `x a`, `rank` columns, is. `dots` and `full` recompute the norm with the rest of the layer
        already."""
        if deterministic or self.remat != "none":
            return projections(self, h, deterministic=deterministic, ctx=ctx)
        remat = nnx.remat(projections, policy=_PROJECTIONS, prevent_cse=False)
        return remat(self, h, deterministic=deterministic, ctx=ctx)

    def _attention_projections(self, h: jax.Array, *, deterministic: bool, ctx: nnx.Context | None) -> Any:
        return self.attention.projections(self.attention_norm(h), deterministic=deterministic, ctx=ctx)

    def _mlp_projections(self, h: jax.Array, *, deterministic: bool, ctx: nnx.Context | None) -> Any:
        return self.mlp.up(self.mlp_norm(h), deterministic=deterministic, ctx=ctx)

    def _moe_projections(self, h: jax.Array, *, deterministic: bool, ctx: nnx.Context | None) -> Any:
        return self.moe.up(self.mlp_norm(h), deterministic=deterministic, ctx=ctx)

    def __call__(
        self,
        h: jax.Array,
        layer: Layer,
        positions: jax.Array,
        segments: jax.Array | None = None,
        *,
        deterministic: bool,
        ctx: nnx.Context | None = None,
    ) -> tuple[jax.Array, Any]:
        forward = type(self)._forward
        if self.remat != "none":
            # Under lax.scan, CSE cannot undo rematerialisation, and preventing it costs speed.
            forward = nnx.remat(forward, policy=_REMAT_POLICIES[self.remat], prevent_cse=not self.scanned)
        if self.scanned and not deterministic and packs():  # a CPU up to JAX 0.10 stacks 16-bit residuals in float32
            return packed_call(forward, self, h, positions, segments, deterministic=deterministic, ctx=ctx, layer=layer)
        return forward(self, h, positions, segments, deterministic=deterministic, ctx=ctx, layer=layer)

    def prefill(self, h: jax.Array, layer: Layer, positions: jax.Array, lengths: jax.Array) -> tuple[jax.Array, None]:
        h = self._residual(h, self.attention.prefill(self.attention_norm(h), positions, lengths, layer),
                           "post_attention_norm")  # fmt: skip
        return self._residual(h, self._feed_forward(h, deterministic=True)[0], "post_mlp_norm"), None

    def decode(self, h: jax.Array, layer: Layer, positions: jax.Array) -> tuple[jax.Array, None]:
        h = self._residual(h, self.attention.decode(self.attention_norm(h), positions, layer), "post_attention_norm")
        return self._residual(h, self._feed_forward(h, deterministic=True)[0], "post_mlp_norm"), None
