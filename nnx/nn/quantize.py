"""Weights stored in 4 bits as bitsandbytes stores them: :class:`QuantizedKernel` and its kind :class:`QuantizedParam`.

QLoRA (Dettmers et al., 2023) keeps a frozen base in 4 bits and trains
low-rank adapters (:class:`nnx.LoRA`) on top. A weight is cut into blocks of
``block`` consecutive values (64 by default), each block scaled by its
largest magnitude (``absmax``) into ``[-1, 1]`` and every value rounded to
the nearest of 16 levels: NF4's quantiles of a normal distribution, or FP4's
1-sign 2-exponent 1-mantissa floats. Two codes share a byte. With double
quantisation the block scales are stored in 8 bits too: less their mean
(``offset``), in blocks of 256 of bitsandbytes' dynamic 8-bit map, each such
block scaled by its own float32 ``nested_absmax``. That is about 4.13 bits a
weight where a float32 base takes 32.

Everything here equals ``bitsandbytes.functional.quantize_4bit`` and
``dequantize_4bit`` (bitsandbytes 0.50, whose CPU backend this reproduces):
the codes, the packing (the first of two values in the high half of its
byte), the block scales, the nested scales and the dequantised weight, for a
weight in PyTorch's ``[out, in]`` layout flattened row-major. The one value
computed differently is ``offset``, the float32 mean of the block scales:
here the correctly rounded mean, where PyTorch's float32 sum depends on its
vector width and thread count (they agree on small weights; on large ones
they may differ in the last bit, which moves no code). A checkpoint that
bitsandbytes wrote is read as it is, its own ``offset`` included.

A :class:`QuantizedKernel` holds one ``[in, out]`` weight (or a stack of
them, ``batch`` leading axes) as :class:`QuantizedParam` s laid out as our
kernels are: ``codes`` ``[in / 2, out]`` (rows ``2i`` and ``2i + 1`` in one
byte), ``absmax`` ``[in / block, out]``, so that they shard along the same
logical axes as the float kernel would. Calling it multiplies by the weight
dequantised in the compute dtype; the backward pass dequantises it again
rather than keeping it, so no layer's full-precision weight outlives its
matmul, and the codes get no gradient. A single row on a CPU (a batch-1
decoding step) is multiplied from the codes, through a table of the row's
products with each byte's two values, by the float32 weights::

    >>> import jax, jax.numpy as jnp
    >>> import nnx
    >>> w = jax.random.normal(jax.random.key(0), (128, 64))
    >>> kernel = nnx.QuantizedKernel(128, 64, value=w)  # nf4, blocks of 64, double-quantised
    >>> kernel(jnp.ones((8, 128)), dtype=jnp.bfloat16).shape
    (8, 64)
    >>> w_4bit = kernel.dequantize(jnp.float32)  # what bitsandbytes' dequantize_4bit gives
    >>> w_4bit.shape, float(jnp.abs(w_4bit - w).mean()) < 0.1  # 16 levels: close, not equal
    ((128, 64), True)

The functions over flat arrays (:func:`quantize_4bit`, :func:`dequantize_4bit`,
:func:`quantize_blockwise`, :func:`double_quantize`, ...) take NumPy or JAX
arrays (``xp``) and give bitsandbytes' own layout, for reading and writing
its checkpoints.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from nnx import spmd
from nnx.containers import Param, stored_value
from nnx.module import Module

Array = Any
Shape = int | Sequence[int]

TYPES = ("nf4", "fp4")
"""The 4-bit types: NormalFloat (QLoRA's) and bitsandbytes' 4-bit float."""
BLOCK_SIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
"""The block sizes bitsandbytes accepts."""
NESTED_BLOCK = 256
"""Block scales per nested block under double quantisation (bitsandbytes' fixed choice)."""

_NF4 = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
# FP4 in bit-pattern order (sign, then two exponent bits and one mantissa bit), before scaling to [-1, 1]; code 8
# is +0, as bitsandbytes' table has it (its `-0` is the integer 0)
_FP4 = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0, 0.0, -0.0625, -8.0, -12.0, -4.0, -6.0, -2.0, -3.0)
_LUT_SIZE = 65536  # bitsandbytes' CPU 8-bit quantiser rounds through a table of this many steps over [-1, 1]


class QuantizedParam(Param):
    """Part of a weight stored quantised (codes, block scales): frozen, never trained.

    A ``QuantizedParam`` is a ``Param``, so a partition that separates
    adapters (``nnx.LoRAParam``) from ``nnx.Param`` puts the quantised base
    with the rest of the frozen weights; its arrays are integers and a few
    scales, not the weight's values: count a :class:`QuantizedKernel` by its
    ``shape``.
    """


# The codebooks
# ------------------------------------------------------------------------------


@functools.cache
def code(type: str) -> np.ndarray:
    """The 16 values (float32, in ``[-1, 1]``) of the 4-bit ``type``, indexed by code: bitsandbytes'
    ``get_4bit_type``."""
    if type not in TYPES:
        raise ValueError(f"4-bit type must be one of {', '.join(TYPES)}, got {type!r}")
    values = np.array(_NF4 if type == "nf4" else _FP4, np.float32)
    values = values / np.abs(values).max()
    values.flags.writeable = False
    return values


@functools.cache
def _bounds(type: str) -> tuple[np.ndarray, np.ndarray]:
    """The midpoints between the sorted values of ``type`` (float32) and the code of each sorted value."""
    values = code(type)
    order = np.argsort(values, kind="stable")
    midpoints = ((values[order[:-1]] + values[order[1:]]) / np.float32(2)).astype(np.float32)
    return midpoints, order.astype(np.uint8)


# The positive half of bitsandbytes' dynamic 8-bit map (`create_dynamic_map()`), as float32: the means of
# consecutive points of linspace(0.1, 1, 2 ** i + 1) times 10 ** (i - 6), i < 7. They are written out because
# PyTorch's float32 linspace rounds some points differently from any one formula (its vectorised loop).
_DYNAMIC_HALF = (
    5.5000004e-07, 3.2500002e-06, 7.75e-06, 2.1249998e-05, 4.375e-05, 6.625e-05, 8.875e-05, 0.00015625001,
    0.00026875004, 0.00038125002, 0.00049375003, 0.0006062501, 0.00071875006, 0.00083125, 0.0009437501,
    0.0012812499, 0.00184375, 0.00240625, 0.00296875, 0.0035312497, 0.00409375, 0.0046562497, 0.0052187503,
    0.00578125, 0.00634375, 0.00690625, 0.00746875, 0.00803125, 0.00859375, 0.009156249, 0.00971875, 0.01140625,
    0.01421875, 0.01703125, 0.019843752, 0.02265625, 0.02546875, 0.028281251, 0.03109375, 0.03390625, 0.036718752,
    0.03953125, 0.042343747, 0.04515625, 0.04796875, 0.05078125, 0.05359375, 0.05640625, 0.059218753, 0.06203125,
    0.06484375, 0.067656256, 0.070468746, 0.07328125, 0.07609375, 0.07890625, 0.08171876, 0.08453125, 0.08734375,
    0.09015625, 0.092968754, 0.09578126, 0.09859375, 0.107031256, 0.12109375, 0.13515624, 0.14921875, 0.16328125,
    0.17734376, 0.19140625, 0.20546874, 0.21953125, 0.23359375, 0.24765624, 0.26171875, 0.27578127, 0.28984374,
    0.30390626, 0.31796873, 0.33203125, 0.34609374, 0.36015624, 0.37421876, 0.38828123, 0.40234375, 0.41640624,
    0.43046874, 0.44453126, 0.45859373, 0.47265625, 0.4867187, 0.50078124, 0.5148437, 0.5289062, 0.54296875,
    0.5570313, 0.5710938, 0.58515626, 0.5992187, 0.61328125, 0.6273438, 0.6414063, 0.65546876, 0.6695312,
    0.68359375, 0.6976563, 0.7117188, 0.72578126, 0.7398437, 0.75390625, 0.7679688, 0.78203124, 0.79609376,
    0.8101562, 0.82421875, 0.8382813, 0.85234374, 0.86640626, 0.8804687, 0.89453125, 0.9085938, 0.92265624,
    0.93671876, 0.9507812, 0.96484375, 0.9789063, 0.99296874,
)  # fmt: skip


@functools.cache
def dynamic_code() -> np.ndarray:
    """bitsandbytes' signed 8-bit dynamic map (``create_dynamic_map()``): 256 sorted float32 values in
    ``[-1, 1]``, what double quantisation stores the block scales in (a checkpoint's ``nested_quant_map``)."""
    half = np.array(_DYNAMIC_HALF, np.float32)
    values = np.concatenate([-half[::-1], np.zeros(1, np.float32), half, np.ones(1, np.float32)])
    values.flags.writeable = False
    return values


@functools.cache
def _dynamic_table() -> np.ndarray:
    """The code of each of :data:`_LUT_SIZE` evenly spaced values over ``[-1, 1]``: the first whose midpoint
    with the next is not below it (bitsandbytes' CPU quantiser rounds through this table)."""
    values = dynamic_code()
    midpoints = (np.float32(0.5) * (values[:-1] + values[1:])).astype(np.float32)
    steps = np.arange(_LUT_SIZE, dtype=np.float32)
    grid = (np.float32(-1) + (np.float32(2) * steps) / np.float32(_LUT_SIZE - 1)).astype(np.float32)
    table = np.searchsorted(midpoints, grid, side="left").astype(np.uint8)
    table.flags.writeable = False
    return table


# Flat arrays, as bitsandbytes lays them out
# ------------------------------------------------------------------------------


def _scales(blocks: Array, xp: Any) -> tuple[Array, Array]:
    """Each row's largest magnitude, and each value times the reciprocal of its row's, clipped to ``[-1, 1]``."""
    absmax = xp.max(xp.abs(blocks), axis=-1)
    # bitsandbytes divides by max(absmax, 1e-38); an all-zero block then scales to zeros, which here does not
    # rest on 1e-38, a subnormal that XLA's CPU flushes to zero
    inverse = xp.where(absmax > 0, _reciprocal(xp.maximum(absmax, np.float32(1e-38)), xp), 0.0).astype(np.float32)
    return absmax, xp.clip(blocks * inverse[..., None], -1.0, 1.0)


def _reciprocal(a: Array, xp: Any) -> Array:
    """``1 / a`` of float32 ``a``, correctly rounded (as bitsandbytes' kernels and NumPy divide) on every backend.

    XLA's GPU backend divides float32 with PTX's ``div.full`` (within 2 units in the last place, not correctly
    rounded): a reciprocal one unit off moves a scaled value across a code's boundary now and then (an H200
    gave 4-bit codes other than bitsandbytes' for a bfloat16 weight in FP4). So with JAX the reciprocal of a
    normal ``a = M 2^(e - 150)`` (``M`` its 24-bit significand) is ``2^48 / M`` by long division in 32-bit
    integers, 8 bits a step, rounded to 24 bits on the next (never a tie: ``2^49 / M`` is whole only for ``M`` a
    power of two, whose reciprocal is exact); other values (zero, subnormal, huge) are divided as XLA divides."""
    if xp is np:
        return np.float32(1) / a
    a = a.astype(jnp.float32)
    bits = lax.bitcast_convert_type(a, jnp.uint32)
    exponent = (bits >> 23) & 0xFF
    m = (bits & 0x7FFFFF) | 0x800000
    q = jnp.uint32(1 << 24) // m  # 1, or 2 when m is 2^23
    r = jnp.uint32(1 << 24) - q * m
    for _ in range(3):  # three more 8-bit digits: q = floor(2^48 / m), r the remainder
        n = r << 8
        digit = n // m
        r = n - digit * m
        q = (q << 8) | digit
    mantissa = (q >> 1) + (q & 1)  # q has 25 bits (26 when m is 2^23): keep 24, rounded on the 25th
    carry = mantissa >> 24  # rounded (or exactly) up to 2^24: one more in the exponent
    mantissa = jnp.where(carry > 0, mantissa >> 1, mantissa)
    biased = jnp.uint32(253) - exponent + carry
    exact = lax.bitcast_convert_type((biased << 23) | (mantissa & 0x7FFFFF), jnp.float32)
    return jnp.where((exponent >= 1) & (exponent <= 252), exact, 1 / a)


def quantize_4bit(w: Array, type: str = "nf4", block: int = 64, xp: Any = np) -> tuple[Array, Array]:
    """``(packed, absmax)`` of ``w`` (any shape and float dtype), flattened row-major, in blocks of ``block``:
    ``packed`` uint8 ``[size / 2]`` (two codes a byte, the first in the high half), ``absmax`` float32
    ``[size / block]``, as ``bitsandbytes.functional.quantize_4bit`` gives them (its ``[size / 2, 1]``
    flattened). ``w.size`` must be a multiple of ``block``.

    Example::

      >>> import numpy as np
      >>> from nnx.nn.quantize import quantize_4bit
      >>> packed, absmax = quantize_4bit(np.linspace(-1, 1, 128, dtype=np.float32))
      >>> packed.shape, absmax.shape
      ((64,), (2,))
    """
    _check(type, block)
    if math.prod(w.shape) % block:
        raise ValueError(f"a weight of {math.prod(w.shape)} values does not divide into blocks of {block}")
    absmax, scaled = _scales(w.reshape(-1, block).astype(np.float32), xp)
    midpoints, order = _bounds(type)
    # how many midpoints lie below each value (torch.bucketize's count); JAX compares with all 15 at once
    search = {} if xp is np else {"method": "compare_all"}
    q = xp.searchsorted(xp.asarray(midpoints), scaled.reshape(-1), side="left", **search)
    if type != "nf4":
        q = xp.asarray(order)[q]
    q = q.astype(np.uint8).reshape(-1, 2)
    return (q[:, 0] << 4) | q[:, 1], absmax.astype(np.float32)


def unpack(packed: Array, xp: Any = np) -> Array:
    """The 4-bit codes of ``packed`` bytes, two per byte, high half first: ``[..., n] -> [..., 2 n]``."""
    return xp.stack([packed >> 4, packed & 15], axis=-1).reshape(*packed.shape[:-1], -1)


def dequantize_4bit(
    packed: Array, absmax: Array, type: str, shape: Sequence[int], dtype: Any = np.float32, xp: Any = np
) -> Array:
    """The weight of shape ``shape`` that ``packed`` and ``absmax`` (float32, from :func:`quantize_4bit` or
    :func:`undo_double_quantize`) hold, in ``dtype``: ``code(type)[c] * absmax`` in float32, then rounded to
    ``dtype``, as ``bitsandbytes.functional.dequantize_4bit``."""
    block = math.prod(shape) // math.prod(absmax.shape)
    values = xp.asarray(code(type))[unpack(packed.reshape(-1), xp).astype(np.int32)]
    return (values.reshape(-1, block) * absmax.reshape(-1, 1).astype(np.float32)).astype(dtype).reshape(shape)


def quantize_blockwise(a: Array, block: int = NESTED_BLOCK, xp: Any = np) -> tuple[Array, Array]:
    """``(codes, absmax)``: float32 ``a`` (flat) in blocks of ``block`` (the last one may be short) in
    bitsandbytes' dynamic 8-bit map (:func:`dynamic_code`), uint8 codes and a float32 scale per block, as
    ``bitsandbytes.functional.quantize_blockwise`` computes them on CPU (rounding through its table)."""
    a = a.reshape(-1).astype(np.float32)
    n = a.shape[0]
    padded = -(-n // block) * block
    blocks = xp.concatenate([a, xp.zeros(padded - n, np.float32)]).reshape(-1, block)
    absmax, scaled = _scales(blocks, xp)
    step = ((scaled + np.float32(1)) * np.float32(0.5) * np.float32(_LUT_SIZE - 1) + np.float32(0.5)).astype(np.float32)
    codes = xp.asarray(_dynamic_table())[step.astype(np.int32)]
    codes = xp.where((absmax == 0)[:, None], np.uint8(0), codes)  # an all-zero block: codes 0
    return codes.reshape(-1)[:n], absmax.astype(np.float32)


def dequantize_blockwise(codes: Array, absmax: Array, block: int = NESTED_BLOCK, xp: Any = np) -> Array:
    """Float32 ``dynamic_code()[codes] * absmax`` of each block of ``block`` codes (flat)."""
    n = codes.shape[0]
    scale = xp.repeat(absmax.astype(np.float32), block)[:n]
    return xp.asarray(dynamic_code())[codes.astype(np.int32)] * scale


def double_quantize(absmax: Array, xp: Any = np) -> tuple[Array, Array, Array]:
    """``(codes, nested_absmax, offset)``: the block scales ``absmax`` (flat, float32) less their mean
    ``offset``, in the dynamic 8-bit map in blocks of :data:`NESTED_BLOCK`, as ``quantize_4bit`` stores them with
    ``compress_statistics=True``. ``offset`` is the float32 mean, correctly rounded with NumPy (see the module
    docstring), a float32 mean with JAX."""
    codes, nested, offset = _double_quantize_rows(absmax.reshape(1, -1).astype(np.float32), xp)
    return codes[0], nested[0], offset[0]


def undo_double_quantize(codes: Array, nested_absmax: Array, offset: Array, xp: Any = np) -> Array:
    """The float32 block scales that :func:`double_quantize` stored: ``dequantize_blockwise(...) + offset``."""
    return dequantize_blockwise(codes, nested_absmax, NESTED_BLOCK, xp) + offset.astype(np.float32)


def _check(type: str, block: int) -> None:
    if type not in TYPES:
        raise ValueError(f"4-bit type must be one of {', '.join(TYPES)}, got {type!r}")
    if block not in BLOCK_SIZES:
        raise ValueError(f"block size must be one of {', '.join(map(str, BLOCK_SIZES))}, got {block!r}")


# Our layout: [in / 2, out] codes, [in / block, out] scales
# ------------------------------------------------------------------------------


def _shape(features: Shape) -> tuple[int, ...]:
    return (features,) if isinstance(features, int) else tuple(features)


def quantize_kernel(
    w: Array, type: str = "nf4", block: int = 64, double_quant: bool = True, xp: Any = np
) -> dict[str, Array]:
    """The arrays a :class:`QuantizedKernel` stores for the kernel ``w`` ``[*batch, in, out]`` (our layout,
    the transpose of PyTorch's ``[out, in]``): ``codes`` ``[*batch, in / 2, out]``, ``absmax`` ``[*batch,
    in / block, out]`` (uint8 when ``double_quant``, else float32), and with ``double_quant`` ``nested_absmax``
    ``[*batch, ceil(in out / block / 256)]`` and ``offset`` ``[*batch]``. Each ``[in, out]`` weight is
    quantised as bitsandbytes quantises its ``[out, in]`` transpose, all at once; ``in`` must be a multiple of
    ``block``."""
    _check(type, block)
    *batch, fan_in, fan_out = w.shape
    if fan_in % block:
        raise ValueError(f"a kernel's input size ({fan_in}) must be a multiple of the block size ({block})")
    if xp is np and math.prod(w.shape) >= _XLA_SIZE and not _has_tiny(w):  # the same codes, computed by XLA
        packed, absmax = (np.asarray(a) for a in _quantize_4bit_xla(type, block)(w))
    else:
        torch_layout = xp.swapaxes(w, -1, -2)  # [*batch, out, in]: bitsandbytes' blocks run along `in`
        packed, absmax = quantize_4bit(torch_layout, type, block, xp)  # each weight a whole number of blocks
    parts = {"codes": xp.swapaxes(packed.reshape(*batch, fan_out, fan_in // 2), -1, -2)}
    absmax = absmax.reshape(*batch, fan_out * fan_in // block)
    if double_quant:
        absmax, parts["nested_absmax"], parts["offset"] = _double_quantize_rows(absmax, xp)
    parts["absmax"] = xp.swapaxes(absmax.reshape(*batch, fan_out, fan_in // block), -1, -2)
    return parts


_XLA_SIZE = 1 << 16
"""Weights of at least this many values that :func:`quantize_kernel` is given as NumPy arrays are quantised to 4
bits by XLA: a model quantised as it loads (`model.quantize`) took 16.7 s for Qwen2.5-0.5B's 358 M weights
in NumPy, whose `searchsorted` of 15 levels alone is 70% of it; XLA compares with all of them at once on every
core, 30x faster (0.007 against 0.216 s for an 896 x 4,864 kernel), giving the same codes and scales."""


def _has_tiny(w: np.ndarray) -> bool:
    """Whether `w` holds a value other than zero below 2^-100 in magnitude, where XLA's CPU (which flushes
    subnormal numbers to zero) could round differently from NumPy and bitsandbytes: FP4's +0 and -0 codes for a
    subnormal scaled value, a whole block's scale if all of it is subnormal. Such kernels stay in NumPy."""
    magnitude = np.abs(w)
    return bool(np.any((magnitude < np.float32(2.0**-100)) & (magnitude > 0)))


@functools.cache
def _quantize_4bit_xla(type: str, block: int) -> Callable[[Array], tuple[Array, Array]]:
    """:func:`quantize_4bit` of a kernel's `[out, in]` transpose (its last two axes swapped), jitted."""
    return jax.jit(lambda w: quantize_4bit(jnp.swapaxes(jnp.asarray(w), -1, -2), type, block, jnp))


def _double_quantize_rows(absmax: Array, xp: Any) -> tuple[Array, Array, Array]:
    """:func:`double_quantize` of each row of `absmax` `[*batch, m]` (one weight's block scales a row) at once:
    each row's nested blocks start at its own first scale (a short last block padded with zeros, which change no
    block's largest magnitude)."""
    *batch, m = absmax.shape
    if xp is np:
        offset = np.mean(absmax, axis=-1, dtype=np.float64).astype(np.float32)
    else:
        offset = xp.mean(absmax, axis=-1)
    nested = -(-m // NESTED_BLOCK)
    centred = absmax - offset[..., None]
    padded = xp.concatenate([centred, xp.zeros((*batch, nested * NESTED_BLOCK - m), np.float32)], axis=-1)
    codes, scales = quantize_blockwise(padded, NESTED_BLOCK, xp)
    codes = codes.reshape(*batch, nested * NESTED_BLOCK)[..., :m]
    return codes, scales.reshape(*batch, nested), offset.astype(np.float32)


def from_bitsandbytes(
    packed: Array, absmax: Array, shape: Sequence[int], nested_absmax: Array | None = None, offset: Array | None = None
) -> dict[str, np.ndarray]:
    """A bitsandbytes weight of PyTorch shape ``shape`` ``[out, in]`` (``packed`` and ``absmax`` flat as its
    checkpoints hold them, the nested scales and offset when double-quantised) in :class:`QuantizedKernel`'s
    layout (see :func:`quantize_kernel`)."""
    fan_out, fan_in = shape
    block = fan_out * fan_in // absmax.size
    parts = {
        "codes": np.asarray(packed).reshape(fan_out, fan_in // 2).T,
        "absmax": np.asarray(absmax).reshape(fan_out, fan_in // block).T,
    }
    if nested_absmax is not None:
        parts["nested_absmax"] = np.asarray(nested_absmax, np.float32).reshape(-1)
        parts["offset"] = np.asarray(offset, np.float32).reshape(())
    return parts


def to_bitsandbytes(parts: dict[str, Array]) -> dict[str, np.ndarray]:
    """The inverse of :func:`from_bitsandbytes` for one weight: ``packed`` ``[out * in / 2]``, ``absmax``
    ``[out * in / block]`` (and ``nested_absmax``, ``offset``), bitsandbytes' flat arrays."""
    out = {
        "packed": np.ascontiguousarray(np.asarray(parts["codes"]).T).reshape(-1),
        "absmax": np.ascontiguousarray(np.asarray(parts["absmax"]).T).reshape(-1),
    }
    if "nested_absmax" in parts:
        out["nested_absmax"] = np.asarray(parts["nested_absmax"], np.float32).reshape(-1)
        out["offset"] = np.asarray(parts["offset"], np.float32).reshape(())
    return out


def dequantize_kernel(parts: dict[str, Array], type: str, dtype: Any, xp: Any = jnp) -> Array:
    """The kernel ``[*batch, in, out]`` that ``parts`` (:func:`quantize_kernel`'s arrays) hold, in ``dtype``:
    each value ``code(type)[c] * absmax`` in float32, then rounded, as ``dequantize_4bit`` computes it."""
    codes, absmax = parts["codes"], _block_scales(parts, xp)
    *batch, half, fan_out = codes.shape
    fan_in, blocks = 2 * half, absmax.shape[-2]
    values = _lookup(codes, _byte_values(type), xp)  # [*batch, in / 2, out, 2]: each byte's two values
    values = xp.moveaxis(values, -1, -2).reshape(*batch, blocks, fan_in // blocks, fan_out)
    return (values * absmax[..., :, None, :]).astype(dtype).reshape(*batch, fan_in, fan_out)


def _block_scales(parts: dict[str, Array], xp: Any) -> Array:
    """The float32 block scales ``[*batch, in / block, out]`` of :func:`quantize_kernel`'s ``parts``, their 8-bit
    codes decoded where double-quantised."""
    absmax = parts["absmax"]
    if "nested_absmax" in parts:
        absmax = _undo_double(absmax, parts["nested_absmax"], parts["offset"], xp)
    return absmax.astype(np.float32)


@functools.cache
def _byte_values(type: str) -> np.ndarray:
    """``[256, 2]`` float32: the values of a byte's two codes, high half first. One lookup per byte, not one per
    code after unpacking: XLA's CPU loop fusing the lookup with a layer's slice of the stacked codes (under the
    layer scan) ran 4x faster so (3.8 against 16 ms for a 896 x 4864 kernel, bitwise the same)."""
    table = code(type).astype(np.float32)
    byte = np.arange(256)
    return np.stack([table[byte >> 4], table[byte & 15]], axis=-1)


def _undo_double(codes: Array, nested: Array, offset: Array, xp: Any) -> Array:
    """Float32 block scales ``[*batch, J, out]`` from their 8-bit ``codes``: block ``(j, o)`` is the
    ``o J + j``-th of the weight in bitsandbytes' order, so its nested scale is the ``(o J + j) // 256``-th."""
    blocks, fan_out = codes.shape[-2:]
    flat = xp.arange(fan_out)[None, :] * blocks + xp.arange(blocks)[:, None]  # [J, out]
    scale = xp.take(nested, flat // NESTED_BLOCK, axis=-1)  # [*batch, J, out]
    values = _lookup(codes, dynamic_code(), xp)
    return values * scale + offset.astype(np.float32)[..., None, None]


def _lookup(codes: Array, table: np.ndarray, xp: Any) -> Array:
    """``table[codes]``, float32."""
    return xp.asarray(table)[codes.astype(np.int32)]


# The Module and its matmul
# ------------------------------------------------------------------------------


class QuantizedKernel(Module):
    """A frozen kernel ``in_features + out_features`` stored in 4 bits (see the module docstring).

    Holds ``codes``, ``absmax`` and, with ``double_quant``, ``nested_absmax``
    and ``offset`` as :class:`QuantizedParam` s (with ``batch`` leading axes
    when it stacks several kernels, a mixture's experts), their logical axes
    ``batch_axes + (in_axes[0], out_axes[0])`` for the codes, ``batch_axes +
    (None, out_axes[0])`` for the block scales. Built
    from ``value`` (a float kernel, quantised here with JAX) or zeros, to be
    filled from a checkpoint.

    Example::

      >>> import jax, jax.numpy as jnp
      >>> import nnx
      >>> kernel = nnx.QuantizedKernel(128, (2, 32), value=jnp.ones((128, 2, 32)))
      >>> kernel.codes.shape, kernel.absmax.shape, kernel.shape
      ((64, 64), (2, 64), (128, 2, 32))
      >>> kernel(jnp.ones((4, 128)), dtype=jnp.float32).shape
      (4, 2, 32)

    Args:
      in_features / out_features: the kernel's input and output shapes; the
        input size (their product) must be a multiple of ``block``.
      type: ``nf4`` or ``fp4``.
      block: values per block scale (32 to 4096, a power of two).
      double_quant: store the block scales in 8 bits too.
      batch: leading axes of stacked kernels.
      in_axes / out_axes / batch_axes: logical axis names, for sharding.
      value: the float kernel ``batch + in_features + out_features`` to quantise.
    """

    def __init__(
        self,
        in_features: Shape,
        out_features: Shape,
        *,
        type: str = "nf4",
        block: int = 64,
        double_quant: bool = True,
        batch: Sequence[int] = (),
        in_axes: Sequence[str | None] | None = None,
        out_axes: Sequence[str | None] | None = None,
        batch_axes: Sequence[str | None] | None = None,
        value: Array | None = None,
    ):
        _check(type, block)
        self.in_shape, self.out_shape, self.batch = _shape(in_features), _shape(out_features), tuple(batch)
        fan_in, fan_out = math.prod(self.in_shape), math.prod(self.out_shape)
        if fan_in % block:
            raise ValueError(f"a 4-bit kernel's input size ({fan_in}) must be a multiple of its block size ({block})")
        self.type, self.block, self.double_quant = type, block, double_quant
        if value is not None:
            value = jnp.asarray(value, jnp.float32).reshape(*self.batch, fan_in, fan_out)
            parts = quantize_kernel(value, type, block, double_quant, xp=jnp)
        else:
            parts = _zeros(self.batch, fan_in, fan_out, block, double_quant)
        axes = None
        if in_axes is not None and out_axes is not None:
            lead = tuple(batch_axes) if batch_axes is not None else (None,) * len(self.batch)
            # the block scales split along the output only: a weight's input has few blocks (896 / 64 = 14), too
            # few to divide among devices, and they are 1/64 of the codes
            axes = {"codes": (*lead, in_axes[0], out_axes[0]), "absmax": (*lead, None, out_axes[0])}
            axes |= {"nested_absmax": (*lead, None), "offset": lead}
        for name, array in parts.items():
            if axes is not None:
                array = spmd.with_logical_partitioning(lambda a=array: a, axes[name])()
            setattr(self, name, QuantizedParam(array))
        if not double_quant:
            self.nested_absmax = self.offset = None

    @property
    def shape(self) -> tuple[int, ...]:
        """The kernel's shape, ``batch + in_features + out_features``."""
        return (*self.batch, *self.in_shape, *self.out_shape)

    def parts(self) -> dict[str, Array]:
        """The stored arrays by name (``codes``, ``absmax``, and ``nested_absmax``, ``offset`` when double), as
        stored: without the sharding constraint reading a logically partitioned one adds. A product reads
        them here (:func:`nnx.containers.stored_value`: under ``nnx.Scan`` a constrained read would be stacked
        again for the backward pass)."""
        names = ("codes", "absmax", "nested_absmax", "offset") if self.double_quant else ("codes", "absmax")
        return {name: stored_value(self, name) for name in names}

    def dequantize(self, dtype: Any = jnp.float32) -> Array:
        """The kernel in ``dtype``, shape :attr:`shape` (after any axes its arrays gained when stacked by
        ``nnx.Scan``): what ``bitsandbytes`` dequantises it to."""
        codes = self.codes
        stacked = codes.shape[: codes.ndim - 2 - len(self.batch)]
        return dequantize_kernel(self.parts(), self.type, dtype).reshape(*stacked, *self.shape)

    def __call__(self, x: Array, *, dtype: Any = None, out_dtype: Any = None) -> Array:
        """``x @ kernel``, contracting the trailing ``len(in_features)`` axes of ``x``, the kernel dequantised in
        ``dtype`` (``x``'s by default, float32 for an integer ``x``, as ``Linear`` promotes it) for this product
        only (again in the backward pass, never kept); a single row on a CPU multiplied from the codes instead
        (:func:`_row_product`)."""
        if self.batch:
            raise ValueError("a stack of kernels (batch axes) is applied with dequantized_product")
        if x.ndim < len(self.in_shape) or x.shape[x.ndim - len(self.in_shape) :] != self.in_shape:
            raise ValueError(
                f"QuantizedKernel expects inputs whose trailing axes have the shape in_features={self.in_shape}, "
                f"got shape {x.shape}."
            )
        dtype = dtype or (x.dtype if jnp.issubdtype(x.dtype, jnp.inexact) else jnp.float32)
        tokens = x.shape[: x.ndim - len(self.in_shape)]
        x2 = x.astype(dtype).reshape(math.prod(tokens), -1)
        if x2.shape[0] == 1 and spmd.platform() == "cpu":  # a batch-1 decoding step
            y = _row_product(_spec(self, dtype, out_dtype), x2, self.parts())
        else:
            y = dequantized_product(_dot, _dot_transpose, x2, self, dtype, out_dtype=out_dtype)
        return y.reshape(*tokens, *self.out_shape)


def _zeros(batch: tuple[int, ...], fan_in: int, fan_out: int, block: int, double: bool) -> dict[str, Array]:
    blocks = fan_in // block
    parts = {
        "codes": jnp.zeros((*batch, fan_in // 2, fan_out), jnp.uint8),
        "absmax": jnp.zeros((*batch, blocks, fan_out), jnp.uint8 if double else jnp.float32),
    }
    if double:
        parts["nested_absmax"] = jnp.zeros((*batch, -(-blocks * fan_out // NESTED_BLOCK)), jnp.float32)
        parts["offset"] = jnp.zeros(batch, jnp.float32)
    return parts


def two_rows(x: Array) -> Array:
    """``x`` ``[rows, in]`` as it is, or on a CPU a single 16-bit row repeated to two: slice the product back to
    ``x``'s rows.

    XLA's CPU multiplies bfloat16 by bfloat16 into float32 as they are stored, but it takes a one-row product
    as a matrix-vector product, and that it computes by widening the whole 16-bit matrix to float32 first:
    every weight, every token of a batch-1 decode (2.5x the time of the two-row product at 896 x 4864, and a
    float32 copy of the matrix in memory). The second row costs next to nothing beside reading the matrix."""
    if x.shape[0] == 1 and x.dtype.itemsize == 2 and spmd.platform() == "cpu":
        return jnp.concatenate([x, x])
    return x


def _dot(x: Array, w: Array, out_dtype: Any) -> Array:
    # accumulated in float32 whatever the output: XLA's CPU product of 16-bit operands runs about 2.5x faster
    # with a float32 result than with a 16-bit one (and rounds once, as a GPU's does)
    product = jax.lax.dot_general(two_rows(x), w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return product[: x.shape[0]].astype(out_dtype or x.dtype)


def _dot_transpose(g: Array, w: Array, out_dtype: Any) -> Array:
    return jax.lax.dot_general(g, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32).astype(g.dtype)


def dequantized_product(
    product: Callable[..., Array],
    transpose: Callable[..., Array],
    x: Array,
    kernel: QuantizedKernel,
    dtype: Any,
    *operands: Array,
    out_dtype: Any = None,
) -> Array:
    """``product(x, w, *operands, out_dtype)`` for the kernel ``w`` that ``kernel`` dequantises to (in ``dtype``,
    flattened to ``[*batch, in, out]``), where ``product`` is linear in ``x`` and ``transpose(g, w, *operands,
    out_dtype)`` is its transpose (the gradient with respect to ``x``).

    The backward pass dequantises ``w`` again instead of saving it: no full-precision weight is kept between
    the passes, only the codes that are in memory anyway. ``kernel`` gets no gradient (it is frozen), nor do
    ``operands`` (integer routing tables, for a mixture's grouped product)::

        >>> import jax, jax.numpy as jnp
        >>> import nnx
        >>> kernel = nnx.QuantizedKernel(64, 32, value=jnp.ones((64, 32)))
        >>> def product(x, w, out_dtype):
        ...   return (x @ w).astype(out_dtype or x.dtype)
        >>> def transpose(g, w, out_dtype):
        ...   return (g @ w.T).astype(out_dtype or g.dtype)
        >>> def f(x):
        ...   return nnx.dequantized_product(product, transpose, x, kernel, jnp.float32).sum()
        >>> jax.grad(f)(jnp.ones((4, 64)))[0, :3]  # ones stay exact in nf4
        Array([32., 32., 32.], dtype=float32)
    """
    return _product(product, transpose, _spec(kernel, dtype, out_dtype), x, kernel.parts(), operands)


def _spec(kernel: QuantizedKernel, dtype: Any, out_dtype: Any) -> tuple:
    """What a product with ``kernel`` is, besides the arrays (static under jit): its type, the dtype it is
    dequantised in, the output's (None: the input's)."""
    return kernel.type, jnp.dtype(dtype), None if out_dtype is None else jnp.dtype(out_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _product(product: Callable, transpose: Callable, spec: tuple, x: Array, parts: dict, operands: tuple) -> Array:
    type, dtype, out_dtype = spec
    return product(x, dequantize_kernel(parts, type, dtype), *operands, out_dtype)


def _product_forward(product, transpose, spec, x, parts, operands):
    return _product(product, transpose, spec, x, parts, operands), (parts, operands, jnp.zeros((), x.dtype))


def _product_backward(product, transpose, spec, saved, g):
    parts, operands, x_like = saved
    type, dtype, _ = spec
    dx = transpose(g.astype(dtype), dequantize_kernel(parts, type, dtype), *operands, None)
    return dx.astype(x_like.dtype), jax.tree.map(no_gradient, parts), jax.tree.map(no_gradient, operands)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _row_product(spec: tuple, x: Array, parts: dict) -> Array:
    """``x`` ``[1, in]`` times the kernel, read from its codes: no dequantised weight.

    The row's consecutive pairs ``(x[2p], x[2p + 1])`` meet a byte ``u`` of row ``p`` of the codes as ``x[2p]
    v_hi(u) + x[2p + 1] v_lo(u)``, so one table ``[in / 2, 256]`` of those sums (computed once, in float32) turns
    every byte into its share of the product by a lookup: a block's shares summed, times its scale, summed
    over the blocks. The weights are the float32 ones ``dequantize_4bit`` gives, not rounded to the compute
    dtype. XLA's CPU has no fused 4-bit product; dequantising first wrote and read a 16-bit copy of the kernel
    and looked up every code: at 896 x 4,864 this took 0.6-0.9 ms where dequantise-then-multiply took 2.1-2.7
    (two rows or more and the lookups of each row cost more than that: those go the other way)."""
    type, _, out_dtype = spec
    codes, absmax = parts["codes"], _block_scales(parts, jnp)
    half, fan_out = codes.shape
    pairs = x[0].astype(jnp.float32).reshape(half, 1, 2)
    values = jnp.asarray(_byte_values(type))  # [256, 2]
    table = pairs[..., 0] * values[:, 0] + pairs[..., 1] * values[:, 1]  # [in / 2, 256]
    shares = jnp.take_along_axis(table, codes.astype(jnp.int32), axis=1)  # [in / 2, out]
    blocks = absmax.shape[-2]
    sums = shares.reshape(blocks, half // blocks, fan_out).sum(axis=1)
    y = jnp.sum(sums * absmax, axis=0)
    return y[None].astype(out_dtype or x.dtype)


def _row_product_forward(spec, x, parts):
    return _row_product(spec, x, parts), (parts, (), jnp.zeros((), x.dtype))


def _row_product_backward(spec, saved, g):
    dx, d_parts, _ = _product_backward(_dot, _dot_transpose, spec, saved, g)
    return dx, d_parts


_row_product.defvjp(_row_product_forward, _row_product_backward)


def no_gradient(a: Array) -> Array:
    """The cotangent of a frozen input ``a`` of a custom VJP: zeros, of ``float0`` for an integer array (4-bit
    codes, 16-bit bits)."""
    if jnp.issubdtype(a.dtype, jnp.inexact):
        return jnp.zeros_like(a)
    return np.zeros(a.shape, jax.dtypes.float0)


_product.defvjp(_product_forward, _product_backward)
