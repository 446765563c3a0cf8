"""A scanned block's 16-bit residuals kept as 16-bit integers on a CPU, where XLA would keep them in float32.

Under `lax.scan` the values a block's backward pass needs (its residuals:
the MLP's gate and up activations, the attention's projections, ...) are
stacked across the layers by `dynamic-update-slice` and read back by
`dynamic-slice`. XLA's CPU backend up to JAX 0.10 has neither for bfloat16,
so it widens each such stack to float32 and converts it back, whole: at
Qwen2.5-0.5B's shapes (24 layers, 1,024 tokens a step) the MLP's two stacks
alone take 912 MiB where their bfloat16 values need 456, beside a bfloat16
copy of each. A GPU, and the CPU from JAX 0.11 on, stack bfloat16 as it is:
:func:`packs` asks the backend which it does.

`packed_call` runs a block's forward under a `jax.custom_vjp` whose forward
rule is `jax.vjp` of the block and whose residuals are that vjp's own, with
every bfloat16 one stored as its bits (`uint16`, which the CPU stacks as it
is) and turned back into bfloat16 for the backward rule. Residuals that are
the block's inputs (its weights: a layer's slice of the stacked parameters)
pass through as they are, so the scan does not stack them again. Only the
inputs that are differentiated (`symbolic_zeros`: a LoRA run's adapters and
`h`, not its frozen base) get a vjp and a cotangent. Values and gradients
are those of the plain call, bit for bit: the same operations run, only the
storage of what is kept between the passes differs.

A loop of a program's own that stacks or slices 16-bit values (a mixture's
blocks of rows, the loss's kept gradient) holds them the same way with
`dense.sliceable` and `dense.as_stored`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.custom_derivatives import CustomVJPPrimal, SymbolicZero

import nnx
from nnx import tracers


def packs() -> bool:
    """Whether 16-bit values are worth keeping as their bits where a program stacks, slices or gathers them: on a
    CPU whose XLA widens bfloat16 stacks to float32 (:func:`widens_bfloat16`). XLA's GPU backend, and its CPU
    backend from JAX 0.11 on, stack, slice and gather bfloat16 as it is; there the bits would only add
    conversions (and under a loop of several steps, a hoisted copy of what they convert)."""
    return nnx.spmd.platform() == "cpu" and widens_bfloat16()


@functools.cache
def widens_bfloat16() -> bool:
    """Whether this JAX's CPU backend widens a stack of bfloat16 (a scan's outputs, `dynamic-update-slice`) to
    float32. Asked of the backend once per process, by compiling a small scan and reading its temporaries: up to
    JAX 0.10 a float32 copy of the stack, from 0.11 on next to none (8 KiB). A backend that does not say is taken
    to widen."""
    rows, width = 8, 4096
    xs = jax.device_put(jnp.ones((rows, width), jnp.bfloat16), jax.devices("cpu")[0])
    program = jax.jit(lambda xs: lax.scan(lambda c, x: (c * x, c * x), xs[0], xs)[1])
    analysis = program.lower(xs).compile().memory_analysis()
    return analysis is None or analysis.temp_size_in_bytes >= rows * width  # a quarter of the widened stack


def _is_primal(x: Any) -> bool:
    return isinstance(x, CustomVJPPrimal)


def _is_zero(x: Any) -> bool:
    return isinstance(x, SymbolicZero)


def packed(fun: Callable[..., Any]) -> Callable[..., Any]:
    """`fun` (of arrays) with the same values and gradients, its bfloat16 residuals kept as `uint16` bits. A
    residual that is one of the leaves of `fun`'s first argument (the weights) is kept as it is given; one
    that is another argument (`h`, which the scan stacks in any case) is packed like the rest."""
    meta: dict[str, Any] = {}

    @jax.custom_vjp
    def run(*args: Any) -> Any:
        return fun(*args)

    def forward(*args: Any) -> tuple[Any, tuple]:
        leaves, tree = jax.tree.flatten(args, is_leaf=_is_primal)
        values = [leaf.value for leaf in leaves]
        live = [i for i, leaf in enumerate(leaves) if leaf.perturbed]

        def differentiated(*live_values: Any) -> Any:
            full = list(values)
            for i, v in zip(live, live_values):
                full[i] = v
            return fun(*jax.tree.unflatten(tree, full))

        out, vjp = jax.vjp(differentiated, *(values[i] for i in live))
        residuals, vjp_tree = jax.tree.flatten(vjp)
        weights = len(jax.tree.leaves(args[0], is_leaf=_is_primal))
        positions = {id(v): i for i, v in enumerate(values)}
        kinds, kept, inputs = [], [], []
        for r in residuals:
            i, bits = positions.get(id(r)), getattr(r, "dtype", None) == jnp.bfloat16
            if i is not None and values[i] is r and (i < weights or not bits):
                kinds.append(len(inputs))  # an input: passed through (a weight slice is not stacked again)
                inputs.append(r)
            elif bits:
                kinds.append("bits")
                kept.append(lax.bitcast_convert_type(r, jnp.uint16))
            else:
                kinds.append("as is")
                kept.append(r)
        meta.update(kinds=kinds, vjp_tree=vjp_tree, live=live, tree=tree, count=len(values))
        return out, (inputs, kept)

    def backward(saved: tuple, g: Any) -> tuple:
        inputs, kept = saved
        stored = iter(kept)
        residuals = []
        for kind in meta["kinds"]:
            if kind == "bits":
                residuals.append(lax.bitcast_convert_type(next(stored), jnp.bfloat16))
            elif kind == "as is":
                residuals.append(next(stored))
            else:
                residuals.append(inputs[kind])
        vjp = jax.tree.unflatten(meta["vjp_tree"], residuals)
        g = jax.tree.map(lambda x: jnp.zeros(x.aval.shape, x.aval.dtype) if _is_zero(x) else x, g, is_leaf=_is_zero)
        cotangents: list[Any] = [None] * meta["count"]
        for i, c in zip(meta["live"], vjp(g)):
            cotangents[i] = c
        return tuple(jax.tree.unflatten(meta["tree"], cotangents))

    run.defvjp(forward, backward, symbolic_zeros=True)
    return run


def packed_call(fun: Callable[..., Any], module: nnx.Module, *args: Any, ctx: nnx.Context | None, **kwargs: Any) -> Any:
    """`fun(module, *args, ctx=ctx, **kwargs)` with its bfloat16 residuals packed (:func:`packed`): `args`, a
    Context's keys and the keyword arguments that are arrays (a scanned layer's index) are traced, the others
    (flags) are Python values. State the call changes is written back, as a lifted transform does."""
    state, moduledef = module.partition()
    traced = {k: v for k, v in kwargs.items() if isinstance(v, jax.Array)}
    flags = {k: v for k, v in kwargs.items() if k not in traced}

    def pure(state: Any, pure_ctx: Any, traced: dict[str, Any], *args: Any) -> tuple[Any, Any]:
        with tracers.nnx_trace():
            inner = moduledef.merge(state)
            out = fun(inner, *args, ctx=None if pure_ctx is None else pure_ctx.merge(), **traced, **flags)
            return inner.get_state(), out

    if ctx is None:
        pure_ctx = None
    else:  # a scanned layer's fresh Context as it is: dropout draws the masks the plain call draws
        try:
            pure_ctx = ctx.partition(fork=False)
        except ValueError:
            pure_ctx = ctx.partition()
    state, out = packed(pure)(state, pure_ctx, traced, *args)
    module.update_state(state)
    return out
