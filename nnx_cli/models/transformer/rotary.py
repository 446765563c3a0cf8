"""Rotary position embeddings (Su et al., 2021), Hugging Face Llama's convention, and their frequency scalings.

The two halves of each head turn together (feature pair `(i, i + head_dim / 2)`),
as Hugging Face's Llama does, so imported weights need no permutation::

    frequencies = rope_frequencies(64, theta=500000.0, scaling=arch.rope_scaling)
    q = rotate(q, positions, frequencies)      # [batch, length, heads, 64] at positions [batch, length]

A new scaling (`model.rope_scaling` of another `type`) is checked in
:func:`check_rope_scaling` and applied in :func:`rope_frequencies`. Given
fewer frequencies than half the head, :func:`rotate` turns only that many
leading pairs' worth of features (Phi-3's partial rotary embedding).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

_ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def check_rope_scaling(value: Mapping[str, Any] | None) -> tuple[tuple[str, Any], ...] | None:
    """`model.rope_scaling`: null, `{type: llama3, factor, low_freq_factor, high_freq_factor,
    original_max_position_embeddings}` or `{type: linear, factor}`; returned as `(key, value)` pairs (hashable,
    for the ModuleDef)."""
    if value is None:
        return None
    if isinstance(value, Mapping) and value.get("type") == "linear":
        return _check_linear(value)
    if not isinstance(value, Mapping) or value.get("type") != "llama3":
        raise ValueError(
            f"model.rope_scaling must be null, {{type: llama3, {', '.join(_ROPE_SCALING_KEYS)}}} or "
            f"{{type: linear, factor}}; got {value!r}"
        )
    missing = [k for k in _ROPE_SCALING_KEYS if not isinstance(value.get(k), (int, float))]
    unknown = sorted(set(value) - {"type", *_ROPE_SCALING_KEYS})
    if missing or unknown:
        problem = f"lacks numbers for {', '.join(missing)}" if missing else f"has unknown keys {', '.join(unknown)}"
        raise ValueError(f"model.rope_scaling of type llama3 {problem}; it takes {', '.join(_ROPE_SCALING_KEYS)}")
    if value["high_freq_factor"] <= value["low_freq_factor"] or value["factor"] <= 0:
        raise ValueError(
            "model.rope_scaling needs factor > 0 and high_freq_factor > low_freq_factor; "
            f"got {value['factor']}, {value['low_freq_factor']}, {value['high_freq_factor']}"
        )
    return tuple((k, float(value[k])) for k in _ROPE_SCALING_KEYS)


def _check_linear(value: Mapping[str, Any]) -> tuple[tuple[str, Any], ...]:
    """`{type: linear, factor}`: every frequency divided by `factor` (positions interpolated)."""
    factor = value.get("factor")
    unknown = sorted(set(value) - {"type", "factor"})
    if unknown:
        raise ValueError(f"model.rope_scaling of type linear has unknown keys {', '.join(unknown)}; it takes factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        raise ValueError(f"model.rope_scaling of type linear needs a positive factor, got {factor!r}")
    return (("type", "linear"), ("factor", float(factor)))


def rope_frequencies(
    head_dim: int, theta: float = 10000.0, scaling: tuple[tuple[str, Any], ...] | None = None
) -> jax.Array:
    """The float32 angular frequencies of rotary feature pairs: `theta ** (-2i / head_dim)`, `i < head_dim / 2`.

    With `scaling` of type llama3 (Meta's Llama 3.1 recipe), wavelengths longer
    than `original_max_position_embeddings / low_freq_factor` slow down by
    `factor`, those shorter than `... / high_freq_factor` stay, and those
    between blend the two smoothly. With type linear, every frequency is
    divided by `factor`.
    """
    half = head_dim // 2
    frequencies = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    if scaling is None:
        return frequencies
    s = dict(scaling)
    if s.get("type") == "linear":
        return frequencies / s["factor"]
    original, low, high, factor = (
        s["original_max_position_embeddings"],
        s["low_freq_factor"],
        s["high_freq_factor"],
        s["factor"],
    )
    wavelength = 2 * math.pi / frequencies
    slowed = jnp.where(wavelength > original / low, frequencies / factor, frequencies)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * slowed / factor + smooth * slowed
    between = (wavelength >= original / high) & (wavelength <= original / low)
    return jnp.where(between, blended, slowed)


def rotate(x: jax.Array, positions: jax.Array, frequencies: jax.Array | None = None) -> jax.Array:
    """Rotary position embedding (Su et al., 2021) of `x` `[batch, length, heads, head_dim]` at `positions`.

    Feature pair `(i, i + head_dim / 2)` turns by `position * frequencies[i]`
    (:func:`rope_frequencies`; by default `10000 ** (-2i / head_dim)`), in
    float32; `positions` is `[batch, length]`. With `n` frequencies fewer
    than `head_dim / 2`, only the first `2 n` features turn (pairs `(i, i + n)`)
    and the rest pass through.
    """
    if frequencies is None:
        frequencies = rope_frequencies(x.shape[-1])
    rotated = 2 * frequencies.shape[-1]
    if rotated < x.shape[-1]:
        return jnp.concatenate([rotate(x[..., :rotated], positions, frequencies), x[..., rotated:]], axis=-1)
    angles = positions.astype(jnp.float32)[:, :, None, None] * frequencies
    sin, cos = jnp.sin(angles), jnp.cos(angles)
    first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1).astype(x.dtype)
