"""Scoring and greedy generation for evaluation harnesses: token requests in, numbers and tokens out.

An :class:`Engine` holds a language model's parameters (a `State` of
`nnx.Param`, on one device or placed over a mesh) and answers the two
questions every benchmark asks of a causal language model, in batches:

- :meth:`Engine.loglikelihoods`: for `(context, continuation)` token lists,
  the log-probability of the continuation after the context and whether
  greedy decoding would have produced it. The input is the last
  `max_length` tokens of `context + continuation[:-1]`, as lm-eval's `hf`
  model feeds it.
- :meth:`Engine.generate`: continuations of prompts from the key-value-cache
  decoder (:mod:`nnx_cli.decoding`), each cut where a caller's test says it
  has reached a stop string.

Requests are sorted by length (longest first) and batched in buckets of
padded lengths (16, 32, 64, 128, 192, 256, 384, ...): a task compiles a
handful of shapes, not one per request. Rows of one batch are split over the
mesh axes of the logical `batch` axis (data parallel); a batch's row count is
a power of two that those axes divide. Continuations that follow the same
context (the choices of a multiple-choice question) are scored after one
pass over it: the context is prefilled into the key-value cache once, the
cache copied to each continuation's row, and the continuations fed one token
per step. Other requests are scored in one pass over context and
continuation, and those whose inputs are the same tokens share a row::

    engine = Engine(moduledef, params, max_length=2048, batch_size=32)
    engine.loglikelihoods([([1, 5, 9], [12]), ([1, 5, 9], [14, 15])])   # [(-3.2, False), (-7.9, False)]
    engine.generate([[1, 5, 9]], max_tokens=16, stop_tokens=[2], done=lambda row, tokens: False)
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import nnx
from nnx_cli import decoding
from nnx_cli.decoding import bucket_length

# Most bytes a batch's float32 logits may take (they are the largest array of a scoring call).
LOGITS_BUDGET = 1 << 30

Progress = Callable[[int], None]


def _floor_power_of_two(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _ceil_power_of_two(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


@dataclasses.dataclass
class _Row:
    """One model input: its tokens and the requests scored on it (same input, possibly another final token)."""

    tokens: list[int]
    requests: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)  # (request, scored, final token)


def _score(moduledef: nnx.ModuleDef, layout: tuple, leaves: list[jax.Array], tokens: jax.Array, lengths: jax.Array,
           finals: jax.Array):  # fmt: skip
    """Per row of right-padded `tokens` `[B, T]` with `lengths` real tokens: the log-probability of each next
    input token (`along[b, t]`: of `tokens[b, t + 1]` after position t), whether it is the argmax (`matches`),
    and at the last real position the log-probabilities of the candidate final tokens `finals` `[B, K]` and the
    argmax there (`best`). The parameters come as `decoding.held_leaves` gives them."""
    params = decoding.from_leaves(layout, leaves)
    logits = moduledef.merge(params).logits(tokens)  # [B, T, V] float32, padded vocabulary masked
    normalizer = jax.nn.logsumexp(logits, axis=-1)
    following = jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)
    along = jnp.take_along_axis(logits, following[..., None], axis=-1)[..., 0] - normalizer
    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    last = (lengths - 1)[:, None]
    at_last = jnp.take_along_axis(logits, last[..., None], axis=1)[:, 0]  # [B, V]
    final = jnp.take_along_axis(at_last, finals, axis=-1) - jnp.take_along_axis(normalizer, last, axis=1)
    best = jnp.take_along_axis(argmax, last, axis=1)[:, 0]
    return along, argmax == following, final, best


def _gather_rows(cache: nnx.State, rows: jax.Array) -> nnx.State:
    """The key-value cache with its rows (the logical `batch` axis of each entry) taken in the order `rows`."""
    return nnx.State({
        path: variable.replace(value=jnp.take(variable.value, rows, axis=list(variable.sharding).index("batch")))
        for path, variable in cache.items()
    })  # fmt: skip


def _score_shared(
    moduledef: nnx.ModuleDef, cache_len: int, layout: tuple, leaves: list[jax.Array], contexts: jax.Array,
    lengths: jax.Array, rows: jax.Array, continuations: jax.Array, counts: jax.Array,
):  # fmt: skip
    """Continuations scored after shared contexts: each context of `contexts` `[U, P]` (right-padded, `lengths`
    real tokens) goes through the model once, its keys and values are copied to the continuations that follow it
    (`rows` `[R]`: a context per continuation), and the continuations `[R, K]` (`counts` real tokens) are fed
    one token per step through the cache. Per continuation: its log-probability and whether every token of it is
    the argmax."""
    model = moduledef.merge(decoding.from_leaves(layout, leaves))
    model.init_cache(contexts.shape[0], cache_len)
    (weights, cache), cachedef = model.partition(nnx.Param, nnx.Cache)
    after, (state, _) = cachedef.apply(weights, cache).prefill(contexts, lengths)  # [U, V] after each context
    cache = _gather_rows(state.filter(nnx.Cache), rows)

    def scored(logits: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
        logprobs = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0] - jax.nn.logsumexp(logits, axis=-1)
        return logprobs, jnp.argmax(logits, axis=-1) == targets

    total, greedy = scored(after[rows], continuations[:, 0])
    positions = lengths[rows]

    def step(carry, t):
        cache, total, greedy = carry
        logits, (state, _) = cachedef.apply(weights, cache).decode(continuations[:, t], positions + t)
        logprobs, matches = scored(logits, continuations[:, t + 1])
        live = t + 1 < counts
        return (state.filter(nnx.Cache), total + jnp.where(live, logprobs, 0.0), greedy & (matches | ~live)), None

    (_, total, greedy), _ = jax.lax.scan(step, (cache, total, greedy), jnp.arange(continuations.shape[1] - 1))
    return total, greedy


# Compiled once per process for each model structure and shape, whichever engine calls them (a training run's
# evaluations, several engines over one model).
_SCORE = jax.jit(_score, static_argnums=(0, 1))
_SCORE_SHARED = jax.jit(_score_shared, static_argnums=(0, 1, 2))


class Engine:
    """Batched log-likelihoods and greedy generation with one model; see the module docstring.

    `params` is every `nnx.Param` of the model (adapters included: they are
    applied, not merged), on one device or placed over `mesh`; `rules` are
    the logical-axis rules the model's sharding constraints follow there.
    `max_length` is the longest input scored (lm-eval's `max_length`).
    `batch_size` is the most rows per call; fewer when a batch's logits would
    exceed :data:`LOGITS_BUDGET`.
    """

    def __init__(
        self,
        moduledef: nnx.ModuleDef,
        params: nnx.State,
        *,
        max_length: int,
        batch_size: int = 32,
        mesh: jax.sharding.Mesh | None = None,
        rules: Sequence[tuple[str, Any]] | None = None,
    ):
        model = moduledef.merge(params)
        self.params, self.moduledef = model.partition(nnx.Param)
        # A bfloat16 table read wider (a bitsandbytes directory at float32) goes to the programs as its bits, in
        # the same memory: given it in bfloat16, each call copied it to its bits to slice it.
        self._tables = decoding.sliced_tables(model)
        self._leaves, self._layout = decoding.held_leaves(self.params, self._tables)
        self.vocab_size: int = model.vocab_size
        self.context_limit: int | None = model.context_limit
        self.max_length = max_length if self.context_limit is None else min(max_length, self.context_limit)
        self.batch_size = batch_size
        self.mesh, self.rules = mesh, list(rules or [])
        one = jnp.zeros((1, 1), jnp.int32)
        logits = jax.eval_shape(lambda p: self.moduledef.merge(p).logits(one), self.params)
        self._padded_vocab = int(logits.shape[-1])
        self._ways, self._rows_sharding = self._batch_split()
        self._score, self._score_shared = _SCORE, _SCORE_SHARED
        self._decoder: Any = None

    def _batch_split(self) -> tuple[int, Any]:
        """How many ways the rows of a batch split over the mesh, and their sharding (None on one device)."""
        if self.mesh is None:
            return 1, None
        axes = nnx.spmd.logical_to_mesh_axes(("batch",), self.rules)[0]
        names = () if axes is None else axes if isinstance(axes, tuple) else (axes,)
        ways = math.prod(self.mesh.shape[a] for a in names)
        return ways, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(axes))

    def set_params(self, params: nnx.State | None) -> None:
        """New values for the same parameters (a training run's current ones); nothing recompiles. None lets go
        of them until the next ones (a training run between two evaluations)."""
        self.params = params.filter(nnx.Param) if hasattr(params, "filter") else params
        self._leaves = None if self.params is None else decoding.held_leaves(self.params, self._tables)[0]
        self._decoder = None

    # --- log-likelihoods ------------------------------------------------------------------------------------

    def loglikelihoods(
        self, requests: Sequence[tuple[Sequence[int], Sequence[int]]], progress: Progress | None = None
    ) -> list[tuple[float, bool]]:
        """`(log P(continuation | context), greedy)` for each `(context, continuation)` of token ids.

        The context must not be empty (lm-eval puts a prefix token there); a
        continuation longer than `max_length` is an error, as in lm-eval.
        Continuations that follow the same context (the choices of a
        multiple-choice question) are scored after one pass over it; the
        others in one pass over context and continuation.
        """
        for i, (context, continuation) in enumerate(requests):
            if not context or not continuation:
                raise ValueError(f"request {i}: the context and the continuation must each hold a token")
            if len(continuation) > self.max_length:
                raise ValueError(
                    f"request {i}: a continuation of {len(continuation)} tokens exceeds the {self.max_length} "
                    "positions the model reads"
                )
        results: list[tuple[float, bool]] = [(0.0, False)] * len(requests)
        contexts: dict[tuple[int, ...], list[int]] = {}
        for i, (context, continuation) in enumerate(requests):
            if len(context) + len(continuation) <= self.max_length + 1:  # nothing cut off the left
                contexts.setdefault(tuple(context), []).append(i)
        shared = {context: group for context, group in contexts.items() if len(group) > 1}
        if shared:
            self._loglikelihoods_shared(requests, shared, results, progress)
        alone = sorted(set(range(len(requests))) - {i for group in shared.values() for i in group})
        self._loglikelihoods_alone(requests, alone, results, progress)
        return results

    def _loglikelihoods_alone(self, requests, indices, results, progress) -> None:
        """Requests scored in one pass over the last `max_length` tokens of context and continuation; those whose
        inputs are the same tokens share a row."""
        rows: dict[tuple[int, ...], _Row] = {}
        for i in indices:
            context, continuation = requests[i]
            whole = (list(context) + list(continuation))[-(self.max_length + 1) :]
            key = tuple(whole[:-1])
            row = rows.setdefault(key, _Row(list(key)))
            row.requests.append((i, len(continuation), whole[-1]))
        ordered = sorted(rows.values(), key=lambda r: (-len(r.tokens), r.tokens))
        finals = _ceil_power_of_two(max(len({f for _, _, f in r.requests}) for r in ordered)) if ordered else 1
        for batch, width, size in self._batches(ordered, lambda r: len(r.tokens)):
            for row, along, matches, final, best in zip(batch, *self._score_batch(batch, width, size, finals)):
                candidates = list(dict.fromkeys(f for _, _, f in row.requests))
                end = len(row.tokens)
                for request, scored, token in row.requests:
                    k = candidates.index(token)
                    start = end - scored
                    logprob = float(np.sum(along[start : end - 1], dtype=np.float64) + final[k])
                    greedy = bool(np.all(matches[start : end - 1]) and best == token)
                    results[request] = (logprob, greedy)
                if progress is not None:
                    progress(len(row.requests))

    def _loglikelihoods_shared(self, requests, shared, results, progress) -> None:
        """Continuations after shared contexts: a batch of contexts (longest first) through the model once each,
        then their continuations, as many rows as they are, one token per step through the copied cache."""
        ordered = sorted(shared.items(), key=lambda item: (-len(item[0]), item[0]))
        for batch, width, size in self._batches(ordered, lambda item: len(item[0]), shared=True):
            members = [i for _, group in batch for i in group]
            longest = max(len(requests[i][1]) for i in members)
            steps = _ceil_power_of_two(longest)
            count = self._split(max(self._ways, _ceil_power_of_two(len(members))))
            contexts = np.zeros((size, width), np.int32)
            lengths = np.ones((size,), np.int32)
            rows = np.zeros((count,), np.int32)
            continuations = np.zeros((count, steps), np.int32)
            counts = np.ones((count,), np.int32)
            r = 0
            for u, (context, group) in enumerate(batch):
                contexts[u, : len(context)] = context
                lengths[u] = len(context)
                for i in group:
                    continuation = requests[i][1]
                    rows[r], counts[r] = u, len(continuation)
                    continuations[r, : len(continuation)] = continuation
                    r += 1
            cache_len = width + steps
            if self.context_limit is not None:
                cache_len = min(cache_len, self.context_limit)
            inputs = (contexts, lengths, rows, continuations, counts)
            if self._rows_sharding is not None:
                inputs = jax.device_put(inputs, self._rows_sharding)
            with self._context():
                out = self._score_shared(self.moduledef, cache_len, self._layout, self._leaves, *inputs)
            total, greedy = (np.asarray(x) for x in jax.device_get(out))
            for r, i in enumerate(members):
                results[i] = (float(total[r]), bool(greedy[r]))
            if progress is not None:
                progress(len(members))

    def _batches(self, items: list[Any], length: Callable[[Any], int], shared: bool = False):
        """`(items, padded length, rows)` per batch: consecutive items of the same length bucket, as many as
        fit; a bucket's last batch is padded up to a power of two rows only. Shared contexts keep no logits
        but the last ones: `batch_size` of them per batch."""
        start = 0
        while start < len(items):
            width = bucket_length(length(items[start]), self.max_length)
            rows = self._split(_floor_power_of_two(self.batch_size)) if shared else self._rows(width)
            stop = start
            while (
                stop < len(items)
                and stop - start < rows
                and bucket_length(length(items[stop]), self.max_length) == width
            ):
                stop += 1
            count = stop - start
            size = rows if count == rows else self._split(max(self._ways, _ceil_power_of_two(count)))
            yield items[start:stop], width, size
            start = stop

    def _rows(self, width: int) -> int:
        """Rows per batch of inputs padded to `width`: `batch_size`, fewer when their logits would exceed the
        budget; a power of two, and a multiple of the ways the batch splits."""
        budget = max(1, LOGITS_BUDGET // (width * self._padded_vocab * 4))
        return self._split(_floor_power_of_two(min(self.batch_size, budget)))

    def _split(self, rows: int) -> int:
        """`rows` rounded up to a multiple of the ways a batch splits over the mesh."""
        return -(-rows // self._ways) * self._ways

    def _score_batch(self, batch: list[_Row], width: int, size: int, finals: int):
        tokens = np.zeros((size, width), np.int32)
        lengths = np.ones((size,), np.int32)
        candidates = np.zeros((size, finals), np.int32)
        for b, row in enumerate(batch):
            tokens[b, : len(row.tokens)] = row.tokens
            lengths[b] = len(row.tokens)
            unique = list(dict.fromkeys(f for _, _, f in row.requests))
            candidates[b, : len(unique)] = unique
        inputs = (tokens, lengths, candidates)
        if self._rows_sharding is not None:
            inputs = jax.device_put(inputs, self._rows_sharding)
        with self._context():
            out = self._score(self.moduledef, self._layout, self._leaves, *inputs)
        return [np.asarray(x)[: len(batch)] for x in jax.device_get(out)]

    def _context(self):
        """The mesh and logical-axis rules the model's sharding constraints refer to (nothing on one device)."""
        if self.mesh is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(jax.set_mesh(self.mesh))
        stack.enter_context(nnx.logical_axis_rules(self.rules))
        return stack

    # --- generation -----------------------------------------------------------------------------------------

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_tokens: int,
        stop_tokens: Sequence[int] = (),
        done: Callable[[int, list[int]], bool] | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        progress: Progress | None = None,
    ) -> list[tuple[list[int], int | None]]:
        """Per prompt: the tokens drawn after it and the stop token that ended them (None if none did).

        A row ends at one of `stop_tokens`, after `max_tokens`, or once
        `done(prompt_index, tokens_so_far)` is true (its tokens up to there
        are returned). Prompts are batched longest first; a batch runs until
        every row in it has ended.
        """
        if self._decoder is None:
            self._decoder = decoding.Decoder(self.moduledef, self.params)
        order = sorted(range(len(prompts)), key=lambda i: (-len(prompts[i]), list(prompts[i])))
        results: list[tuple[list[int], int | None]] = [([], None)] * len(prompts)
        rows = _floor_power_of_two(self.batch_size)
        for start in range(0, len(order), rows):
            chosen = order[start : start + rows]
            # A short last batch is padded to a multiple of 8 rows, not a power of two: every row is a prompt
            # prefilled in full (24 prompts in 32 rows spent a third of the prefill on copies).
            size = min(rows, -(-len(chosen) // 8) * 8)
            batch = [list(prompts[i]) for i in chosen] + [list(prompts[chosen[0]])] * (size - len(chosen))
            drawn = self._decoder.generate(
                batch, max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                stop_tokens=stop_tokens, first_sample=start,
            )  # fmt: skip
            cut: list[int | None] = [None] * len(chosen)
            with self._context():
                for _ in drawn:
                    for b, i in enumerate(chosen):
                        if cut[b] is None and drawn.stop_reasons[b] is None and done and done(i, drawn.samples[b]):
                            cut[b] = len(drawn.samples[b])
                    if all(cut[b] is not None or drawn.stop_reasons[b] is not None for b in range(len(chosen))):
                        break
            for b, i in enumerate(chosen):
                if cut[b] is not None:
                    results[i] = (drawn.samples[b][: cut[b]], None)
                else:
                    results[i] = (list(drawn.samples[b]), drawn.stopped_by[b])
            if progress is not None:
                progress(len(chosen))
        return results
