"""Drawing text from a language model with a key-value cache.

A prompt goes through one jitted *prefill* (compiled per prompt-length
bucket: :func:`bucket_length`), then one jitted *decode step* per token, compiled once
per batch size and cache length and reused for every token. Both are pure
functions of the parameters (a `State` of `nnx.Param`, as restored from a
checkpoint) and the cache; the model's `ModuleDef` is their static argument::

    (params, _), moduledef = model.partition(nnx.Param, ...)
    run = generate(moduledef, params, [list(b"ROMEO:")], max_tokens=200, temperature=0.8, seed=0,
                   end_of_document=256)
    text = Utf8Decoder()
    for tokens in run:                      # one tuple per step: a token per sample (None once it stopped)
        print(text.decode(tokens[:1]), end="", flush=True)
    print(text.flush())
    run.samples, run.stop_reasons, run.truncated

Sampling: `temperature` 0 is greedy (argmax); otherwise logits are divided by
the temperature, then `top_k` (0: off) keeps the k most likely tokens and
`top_p` (1.0: off) the smallest set whose probability reaches p. Sample `i`
draws token `t` with `fold_in(fold_in(key(seed), i), t)`, so a batch of
samples equals single runs with the same sample indices (`first_sample`).

A sample stops after `max_tokens`, at the `end_of_document` token or one of
`stop_tokens` (a model directory's end-of-sequence and end-of-turn ids; the
token is not included in its tokens but kept in `stopped_by`), or when its
sequence fills the model's context (learned positions end at `seq_len`:
`stop_reasons[i] == "context"`, `truncated[i]` true). The model must offer `init_cache(batch_size, max_len)`,
`prefill(tokens, lengths)`, `decode(tokens, positions)`, `context_limit` and
`vocab_size`, as `nnx_cli.models.TransformerLM` does.
"""

from __future__ import annotations

import codecs
import collections
import functools
from collections.abc import Collection, Iterable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import nnx
from nnx_cli import sharding
from nnx_cli.errors import UserError
from nnx_cli.models.transformer.residuals import packs

MIN_BUCKET = 16
"""The smallest prompt bucket: prompts are right-padded to a :func:`bucket_length` at least this long."""

trace_counts: collections.Counter[str] = collections.Counter()
"""How many times `prefill` and `decode` were traced (compiled): one more per new shape, never one per token."""

_MASKED = -1e30


def bucket_length(length: int, limit: int | None = None) -> int:
    """The padded length of `length` tokens: 16, 32, 64, 128, 192, 256, 384, 512, 768, ... (at most `limit`).

    Powers of two, with their midpoints from 128 on: a handful of compiled shapes, and at most a third of a
    long prompt (or cache) spent on padding rather than half.

    >>> [bucket_length(n) for n in (1, 17, 100, 129, 200, 300)]
    [16, 32, 128, 192, 256, 384]
    """
    bucket = MIN_BUCKET
    while bucket < length:
        power = 1 << (bucket.bit_length() - 1)
        bucket = power * 3 // 2 if bucket == power and power >= 128 else power * 2
    return min(bucket, limit) if limit is not None else bucket


# Sampling
# ------------------------------------------------------------------------------


def _keep_top_k(logits: jax.Array, k: jax.Array) -> jax.Array:
    descending = -jnp.sort(-logits, axis=-1)
    kth = jnp.take_along_axis(descending, jnp.clip(k - 1, 0, logits.shape[-1] - 1)[None, None], axis=-1)
    return jnp.where(logits >= kth, logits, _MASKED)


def _keep_top_p(logits: jax.Array, p: jax.Array) -> jax.Array:
    descending = -jnp.sort(-logits, axis=-1)
    probs = jax.nn.softmax(descending, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs  # the mass of the more likely tokens
    kept = jnp.sum(before < p, axis=-1, keepdims=True)  # at least 1: the first has nothing before it
    smallest = jnp.take_along_axis(descending, kept - 1, axis=-1)
    return jnp.where(logits >= smallest, logits, _MASKED)


@functools.partial(jax.jit, static_argnames=("greedy", "use_top_k", "use_top_p"))
def _sample(
    logits: jax.Array,
    keys: jax.Array,
    index: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    *,
    greedy: bool,
    use_top_k: bool,
    use_top_p: bool,
) -> jax.Array:
    if greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    # the model's padded vocabulary rows hold a finite -1e30: divided by a temperature of 1e28 they came within
    # the noise's reach and were drawn (tokens the tokenizer does not have); they stay out at any temperature
    logits = jnp.where(logits > _MASKED, logits / temperature, -jnp.inf)
    if use_top_k:
        logits = _keep_top_k(logits, top_k)
    if use_top_p:
        logits = _keep_top_p(logits, top_p)
    step_keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, index)
    return jax.vmap(jax.random.categorical)(step_keys, logits).astype(jnp.int32)


def sample_tokens(
    logits: jax.Array,
    keys: jax.Array,
    index: int | jax.Array,
    *,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> jax.Array:
    """One token per row of `logits` `[B, V]`; row `b` draws with `fold_in(keys[b], index)`.

    `temperature` 0 is argmax; `top_k` 0 and `top_p` 1.0 turn those filters off::

        keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(0), i))(jnp.arange(4))
        sample_tokens(logits, keys, 0, temperature=0.8, top_k=40)   # int32 [4]
    """
    return _sample(
        logits, keys, index, *_sampling_arrays(temperature, top_k, top_p), **_sampling_flags(temperature, top_k, top_p)
    )


def _sampling_flags(temperature: float, top_k: int, top_p: float) -> dict[str, bool]:
    """Which code the sampler compiles; the values themselves are traced, so changing them does not recompile."""
    return {"greedy": temperature == 0, "use_top_k": top_k > 0, "use_top_p": top_p < 1.0}


def _sampling_arrays(temperature: float, top_k: int, top_p: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    return jnp.float32(max(temperature, 1e-6)), jnp.int32(top_k), jnp.float32(top_p)


# The jitted prefill and decode step
# ------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=("moduledef", "batch_size", "max_len"))
def _new_cache(moduledef: nnx.ModuleDef, params: nnx.State, batch_size: int, max_len: int):
    model = moduledef.merge(params)
    model.init_cache(batch_size, max_len)
    (_, cache), cachedef = model.partition(nnx.Param, nnx.Cache)
    return cache, cachedef


def from_leaves(layout: tuple, leaves: list[jax.Array]) -> nnx.State:
    """Parameters from :func:`held_leaves`' leaves and layout, those held as their bits in bfloat16 again (inside a
    jitted function, where that conversion folds away)."""
    treedef, bits = layout
    return treedef.unflatten([jax.lax.bitcast_convert_type(x, jnp.bfloat16) if b else x for x, b in zip(leaves, bits)])


def _prefill_impl(cachedef, layout, leaves, cache, tokens, lengths, keys, sampling, flags, shared):
    trace_counts["prefill"] += 1
    logits, (state, _) = cachedef.apply(from_leaves(layout, leaves), cache).prefill(tokens, lengths)
    first = _sample(logits, keys, jnp.int32(0), *sampling, **dict(flags))
    if shared is not None:
        first = jax.lax.with_sharding_constraint(first, shared)
    # The decode step's first positions and draw index come out of here, not from the host: arguments made
    # on the host are placed differently from a jitted step's outputs, so the step compiled a second time.
    return first, state.filter(nnx.Cache), lengths, jnp.int32(1)


def _decode_impl(cachedef, layout, cache_len, leaves, cache, tokens, positions, index, keys, sampling, flags, shared):
    trace_counts["decode"] += 1
    at = jnp.minimum(positions, cache_len - 1)  # rows past the end have stopped; keep them in bounds
    logits, (state, _) = cachedef.apply(from_leaves(layout, leaves), cache).decode(tokens, at)
    following = _sample(logits, keys, index, *sampling, **dict(flags))
    if shared is not None:
        following = jax.lax.with_sharding_constraint(following, shared)
    return following, state.filter(nnx.Cache), positions + 1, index + 1


_prefill = jax.jit(_prefill_impl, static_argnums=(0, 1, 8, 9), donate_argnums=(3,))
_decode = jax.jit(_decode_impl, static_argnums=(0, 1, 2, 10, 11), donate_argnums=(4,))


def readable_everywhere(leaves: list[jax.Array]) -> jax.sharding.Sharding | None:
    """Where a decode step's tokens go so that every process can read them: replicated over the mesh of
    parameters that span other processes' devices (a multi-process run's samples), or None when this process
    holds every parameter. Left to the compiler, the tokens were split over the processes, and reading them
    back on the host failed."""
    for leaf in leaves:
        if not leaf.is_fully_addressable and isinstance(leaf.sharding, jax.sharding.NamedSharding):
            return jax.sharding.NamedSharding(leaf.sharding.mesh, jax.sharding.PartitionSpec())
    return None


# Generation
# ------------------------------------------------------------------------------


def sliced_tables(model: nnx.Module) -> set[str]:
    """The paths of `model`'s bfloat16 embedding tables that compute wider than they are stored (`model.dtype:
    float32` over a 16-bit base, a bitsandbytes directory's default), which a decoding step on a CPU reads as
    bits (:func:`_bits`)."""
    return {
        f"{path}/embedding" if path else "embedding"
        for path, m in model.modules()
        if isinstance(m, nnx.Embed)
        and m.embedding.dtype == jnp.bfloat16
        and m.dtype is not None  # None: it computes in the table's own dtype
        and jnp.dtype(m.dtype) != jnp.bfloat16
    }


def held_leaves(params: nnx.State, tables: set[str]) -> tuple[list[jax.Array], tuple]:
    """`params` as the leaves a jitted step on a CPU is best given, and their layout (:func:`from_leaves` takes
    both back): the bfloat16 embedding tables at the paths `tables` (:func:`sliced_tables`, those the model reads
    wider) as their bits, in the same memory (:func:`_bits`), every other leaf as it is."""
    held = nnx.State({path: v.replace(value=_bits(v.value)) if path in tables else v for path, v in params.items()})
    leaves, treedef = jax.tree.flatten(held)
    given = jax.tree.leaves(params)  # the same order: a leaf held as bits was given in bfloat16
    bits = tuple(x.dtype == jnp.uint16 and g.dtype == jnp.bfloat16 for x, g in zip(leaves, given, strict=True))
    return leaves, (treedef, bits)


def _bits(table: jax.Array) -> jax.Array:
    """A bfloat16 embedding table on one CPU device that widens bfloat16 (:func:`.residuals.packs`) as its bits
    (`uint16`), in the same memory; else as it is.

    A step that computes wider than the table is stored slices it (the tied head reads it a chunk at a time, in float32)
    and gathers from it (the token lookup) as bits: XLA's CPU up to JAX 0.10 has neither for bfloat16. Given the table
    in bfloat16, the step converted it to its bits every time, a copy of the table in each step (272 MB at Qwen2.5's
    151,936 x 896, the batch-1 step 1.5x the time); given its bits, the conversion there and back folds away. Only those
    tables: a bfloat16 head against bfloat16 rows is one product over the table as stored, and given its bits it was
    converted back whole, a copy in each step (16 -> 98 ms for that head); a per-layer kernel given as bits, the same
    for every kernel."""
    bits = sharding.same_memory(table, np.uint16) if packs() else None
    return table if bits is None else bits


class Decoder:
    """Prefill and decode for one language model; build it once, call :meth:`generate` many times.

    `params` is a `State` of `nnx.Param` (what a checkpoint restores),
    `moduledef` the model's structure. A scanned model is decoded on
    per-layer copies of its weights (`unstack_layers`; not its 4-bit ones,
    see `TransformerLM.for_decoding`), which is faster (one layer's slice of
    stacked weights is copied at every step) at the price of that copy's
    memory::

        decoder = Decoder(moduledef, params)
        decoder.generate([prompt], max_tokens=100, temperature=0).finish().samples
    """

    def __init__(self, moduledef: nnx.ModuleDef, params: nnx.State, *, unstack_layers: bool = True):
        model = moduledef.merge(params)
        missing = [name for name in ("init_cache", "prefill", "decode", "context_limit") if not hasattr(model, name)]
        if missing:
            raise UserError(
                f"model {type(model).__name__} is not a language model with a key-value cache (it has no "
                f"{', '.join(missing)}); sampling needs a model such as transformer_lm"
            )
        if hasattr(model, "for_decoding"):  # per-layer weights; 16-bit ones rounded once, not at every token
            model = model.for_decoding(unstack=unstack_layers)
        self.params, self.moduledef = model.partition(nnx.Param)
        self.context_limit: int | None = model.context_limit
        self.vocab_size: int = model.vocab_size
        self._leaves, self._layout = held_leaves(self.params, sliced_tables(model))
        self._shared = readable_everywhere(self._leaves)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | jax.Array = 0,
        end_of_document: int | None = None,
        first_sample: int = 0,
        stop_tokens: Collection[int] = (),
    ) -> Generation:
        """Starts drawing up to `max_tokens` tokens after each prompt (token ids); iterate the result.

        `seed` is an int or a key; sample `i` (counting from `first_sample`)
        uses `fold_in(key, i)`.
        """
        prompts = [list(p) for p in prompts]
        self._check(prompts, max_tokens, temperature, top_k, top_p)
        longest = max(len(p) for p in prompts)
        if self.context_limit is not None:
            cache_len = self.context_limit
        else:
            cache_len = bucket_length(longest + max_tokens - 1)
        width = min(bucket_length(longest), cache_len)
        tokens = np.zeros((len(prompts), width), np.int32)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = prompt
        lengths = np.array([len(p) for p in prompts], np.int32)
        root = jax.random.key(seed) if isinstance(seed, (int, np.integer)) else seed
        samples = jnp.arange(first_sample, first_sample + len(prompts), dtype=jnp.uint32)
        keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(root, samples)
        sampling = _sampling_arrays(temperature, top_k, top_p)
        flags = tuple(_sampling_flags(temperature, top_k, top_p).items())
        stops = (frozenset(stop_tokens), end_of_document)
        return Generation(self, tokens, lengths, cache_len, keys, sampling, flags, max_tokens, stops)

    def _check(self, prompts: list[list[int]], max_tokens: int, temperature: float, top_k: int, top_p: float) -> None:
        if not prompts:
            raise UserError("no prompt to continue: give at least one")
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise UserError(f"prompt {i} is empty: give it at least one token")
            if self.context_limit is not None and len(prompt) > self.context_limit:
                raise UserError(
                    f"prompt {i} has {len(prompt)} tokens, more than the model's context of {self.context_limit}; "
                    "shorten it"
                )
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise UserError(f"prompt {i} holds token ids outside the vocabulary [0, {self.vocab_size}): {bad[:5]}")
        if max_tokens < 1:
            raise UserError(f"max_tokens must be at least 1, got {max_tokens}")
        if not temperature >= 0 or temperature == float("inf"):  # NaN too: it drew token 0 every time
            raise UserError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature}")
        if top_k < 0:
            raise UserError(f"top_k must be >= 0 (0 turns it off), got {top_k}")
        if not 0.0 < top_p <= 1.0:
            raise UserError(f"top_p must be in (0, 1] (1 turns it off), got {top_p}")


class Generation(Iterator[tuple[int | None, ...]]):
    """The tokens of a :meth:`Decoder.generate` call, drawn as it is iterated.

    Each step yields one entry per sample: the token just drawn, or None
    for a sample that has stopped. `samples` (token lists, prompts
    excluded), `stop_reasons` (`"max_tokens"`, `"end_of_document"`,
    `"stop_token"` or `"context"`; None while running) and `stopped_by`
    (the end-of-document or stop token that ended a sample, else None) fill
    in as it goes; :meth:`finish` runs it to the end.
    """

    def __init__(
        self,
        decoder: Decoder,
        tokens: np.ndarray,
        lengths: np.ndarray,
        cache_len: int,
        keys: jax.Array,
        sampling: tuple[jax.Array, ...],
        flags: tuple[tuple[str, bool], ...],
        max_tokens: int,
        stops: tuple[frozenset[int], int | None],
    ):
        self.samples: list[list[int]] = [[] for _ in lengths]
        self.stop_reasons: list[str | None] = [None for _ in lengths]
        self.stopped_by: list[int | None] = [None for _ in lengths]
        self._steps = self._run(decoder, tokens, lengths, cache_len, keys, sampling, flags, max_tokens, *stops)

    @property
    def truncated(self) -> list[bool]:
        """Per sample: whether it stopped because its sequence filled the model's context."""
        return [reason == "context" for reason in self.stop_reasons]

    def __next__(self) -> tuple[int | None, ...]:
        return next(self._steps)

    def finish(self) -> Generation:
        """Draws every remaining token; returns self."""
        collections.deque(self._steps, maxlen=0)
        return self

    def _run(
        self, decoder, tokens, lengths, cache_len, keys, sampling, flags, max_tokens, stop_tokens, end_of_document
    ):
        batch = len(lengths)
        cache, cachedef = _new_cache(decoder.moduledef, decoder.params, batch, cache_len)
        leaves, layout = decoder._leaves, decoder._layout
        shared = decoder._shared
        drawn, cache, positions, index = _prefill(
            cachedef, layout, leaves, cache, tokens, lengths, keys, sampling, flags, shared
        )
        # `fed[b]`: where sample b's latest token goes if it is fed back; it fits while fed[b] < cache_len.
        fed = [int(n) for n in lengths]
        for t in range(max_tokens):
            running = [b for b in range(batch) if self.stop_reasons[b] is None]
            following = None
            if t + 1 < max_tokens and any(fed[b] < cache_len for b in running):
                # Dispatched before this step's tokens are read back, so the device works while the host waits.
                following, cache, positions, index = _decode(
                    cachedef, layout, cache_len, leaves, cache, drawn, positions, index, keys, sampling, flags, shared
                )
            step: list[int | None] = [None] * batch
            for b, token in enumerate(np.asarray(drawn).tolist()):
                if self.stop_reasons[b] is not None:
                    continue
                if token == end_of_document or token in stop_tokens:
                    self.stop_reasons[b] = "end_of_document" if token == end_of_document else "stop_token"
                    self.stopped_by[b] = token
                    continue
                self.samples[b].append(token)
                step[b] = token
                if t + 1 == max_tokens:
                    self.stop_reasons[b] = "max_tokens"
                elif fed[b] >= cache_len:
                    self.stop_reasons[b] = "context"
                fed[b] += 1
            if any(token is not None for token in step):
                yield tuple(step)
            if following is None or all(reason is not None for reason in self.stop_reasons):
                break
            drawn = following


def generate(
    moduledef: nnx.ModuleDef,
    params: nnx.State,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | jax.Array = 0,
    end_of_document: int | None = None,
    first_sample: int = 0,
    stop_tokens: Collection[int] = (),
) -> Generation:
    """`Decoder(moduledef, params).generate(prompts, ...)`; see :class:`Decoder` and the module docstring."""
    return Decoder(moduledef, params).generate(
        prompts,
        max_tokens=max_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        end_of_document=end_of_document,
        first_sample=first_sample,
        stop_tokens=stop_tokens,
    )


# Text
# ------------------------------------------------------------------------------


class Utf8Decoder:
    """Byte tokens to text as they arrive: the first bytes of an unfinished character wait for the rest.

    Bytes that cannot be UTF-8 become U+FFFD::

        text = Utf8Decoder()
        text.decode([0xC3])    # ''   (first byte of 'é')
        text.decode([0xA9])    # 'é'
        text.flush()           # ''   (what is left at the end, as U+FFFD)
    """

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def decode(self, tokens: Iterable[int | None]) -> str:
        """Text completed by `tokens` (byte values; None entries are skipped)."""
        data = [t for t in tokens if t is not None]
        if any(not 0 <= t < 256 for t in data):
            raise ValueError(f"byte tokens are in [0, 256), got {[t for t in data if not 0 <= t < 256][:5]}")
        return self._decoder.decode(bytes(data))

    def flush(self) -> str:
        """The held-back bytes of an unfinished character, as U+FFFD; resets for a new text."""
        return self._decoder.decode(b"", final=True)


def decode_bytes(tokens: Iterable[int]) -> str:
    """Text of a whole list of byte tokens (invalid UTF-8 as U+FFFD)."""
    text = Utf8Decoder()
    return text.decode(tokens) + text.flush()


def text_of(tokenizer: Any, tokens: list[int]) -> str:
    """Tokens as text, by the data's tokenizer; for bytes (a tokenizer with `to_bytes`), invalid UTF-8 shows as
    U+FFFD."""
    if hasattr(tokenizer, "to_bytes"):
        return decode_bytes(t for t in tokens if t != tokenizer.eod_id)  # dropped, as its decode() drops it
    return tokenizer.decode(tokens)
