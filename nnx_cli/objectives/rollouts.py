"""GRPO's rollouts: completions sampled inside jit with the key-value cache, scored on the host, trained on.

Each GRPO step (one dispatch of the training loop, `objective.num_iterations`
optimizer steps) runs three stages::

    drawn = rollouts.draw(state, prompts, key)     # jit: prefill, then a while-loop of decode steps, all on device
    per_function = rollouts.score(...)            # host: the reward functions on the decoded texts
    state, sums, finite = round(state, sums, rows) # jit: num_iterations of steps.train_step on the same rows

The objective (`exp.objective`, GRPO) turns scored completions into the rows
a step trains on (`objective.rows`); the loop hands in `steps`, the training
step (`objectives.Steps`): this module imports neither, so no import runs in
a circle.

Sampling is one jitted call per batch: the prompts (each repeated
`num_generations` times) are prefilled into a cache of `P + max_new_tokens -
1` positions, then one token per row is drawn and fed back in a
`lax.while_loop` that ends when every row has drawn a stop token (the
tokenizer's end-of-sequence ids, as TRL stops; `<eos>`-less tokenizers at
end-of-document: `data.tokenizers.stop_ids`) or `max_new_tokens` tokens. Row `i` of step `s` draws its
`t`-th token with `fold_in(fold_in(key(seed, stream, s), i), t)`: a pure
function of the run's seed and step, so a run resumed after kill -9 samples
exactly what the uninterrupted one did, and the rows' keys do not depend on
how the batch is split over devices.

Evaluation samples the eval prompts the same way (keys from the eval batch's
index: every eval of a run draws with the same keys) and reports the reward
metrics; `samples/<step>.txt` shows the first two eval prompts with the
completions the eval drew for them and their rewards.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import nnx
from nnx_cli.errors import UserError
from nnx_cli.objectives import rewards as reward_functions

TrainState = dict[str, Any]  # as `steps` defines it: {"step", "params", "opt_state", "rest", ...}

_SAMPLE, _EVAL_SAMPLE = 3, 4  # key streams (steps uses 0-2: training, evals, images)
SHOWN_PROMPTS = 2
"""Eval prompts whose completions `samples/<step>.txt` shows."""


def stream_key(seed: int, stream: int, index: int) -> jax.Array:
    """The key of `(seed, stream, index)`, as `steps` derives its own."""
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), stream), index)


def sample_completions(moduledef: nnx.ModuleDef, states: tuple, tokens: jax.Array, lengths: jax.Array,
                       key: jax.Array, *, max_new_tokens: int, temperature: float, stop_ids: tuple[int, ...]
                       ) -> dict[str, jax.Array]:  # fmt: skip
    """Completions of right-padded prompts `tokens` `[N, P]` (`lengths` real tokens each); jit it.

    Returns `completions` int32 `[N, max_new_tokens]` (zero after a row's stop token), `lengths` (tokens drawn,
    the stop token included) and `stopped` (whether the row ended on a stop token, else it was cut)."""
    model = moduledef.merge(*states)
    if hasattr(model, "for_decoding"):  # 16-bit weights rounded once, not in every step; 4-bit ones stay stacked
        model = model.for_decoding()
    n, width = tokens.shape
    model.init_cache(n, width + max_new_tokens - 1)
    row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(n, dtype=jnp.uint32))
    stops = jnp.asarray(stop_ids, jnp.int32)
    lengths = jnp.asarray(lengths, jnp.int32)

    def draw(logits: jax.Array, t: jax.Array) -> jax.Array:
        keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, t)
        return jax.vmap(jax.random.categorical)(keys, logits / temperature).astype(jnp.int32)

    first = draw(model.prefill(tokens, lengths), jnp.uint32(0))
    (cache, rest), cachedef = model.partition(nnx.Cache, ...)
    out = jnp.zeros((n, max_new_tokens), jnp.int32).at[:, 0].set(first)

    def more(carry: tuple) -> jax.Array:
        t, _, done, _, _ = carry
        return (t + 1 < max_new_tokens) & ~jnp.all(done)

    def step(carry: tuple) -> tuple:
        t, token, done, out, cache = carry
        logits, updated = cachedef.apply(cache, rest).decode(token, lengths + t)
        following = jnp.where(done, 0, draw(logits, (t + 1).astype(jnp.uint32)))
        out = jax.lax.dynamic_update_slice_in_dim(out, following[:, None], t + 1, axis=1)
        return t + 1, following, done | jnp.isin(following, stops), out, updated.filter(nnx.Cache)

    start = (jnp.int32(0), first, jnp.isin(first, stops), out, cache)
    _, _, _, out, _ = jax.lax.while_loop(more, step, start)
    is_stop = jnp.isin(out, stops)
    stopped = jnp.any(is_stop, axis=1)
    drawn = jnp.where(stopped, jnp.argmax(is_stop, axis=1) + 1, max_new_tokens).astype(jnp.int32)
    return {"completions": out, "lengths": drawn, "stopped": stopped}


@functools.lru_cache(maxsize=4)
def _sampler(moduledef: nnx.ModuleDef, max_new_tokens: int, temperature: float, stops: tuple[int, ...],
             stored: Callable[[Any], Any]) -> Any:  # fmt: skip
    """`sample_completions` jitted once per model and settings: training, evals and samples share its compilations.
    It takes the states as the train state holds them, frozen parameters maybe as their bits (`stored` gives them
    in bfloat16 again inside the jitted function, where that costs nothing: `steps.frozen_as_bits`)."""

    def fn(states: tuple, tokens: jax.Array, lengths: jax.Array, key: jax.Array) -> dict[str, jax.Array]:
        return sample_completions(moduledef, stored(states), tokens, lengths, key, max_new_tokens=max_new_tokens,
                                  temperature=temperature, stop_ids=stops)  # fmt: skip

    return jax.jit(fn)


def completion_texts(tokenizer: Any, drawn: dict[str, np.ndarray]) -> list[str]:
    """Each completion's text (`completions`, `lengths`, `stopped` as `sample_completions` gives them): without the
    prompt and without its stop token, and without any special token drawn on the way, as TRL decodes them
    (`batch_decode(..., skip_special_tokens=True)`): a `<s>` drawn mid-completion is no text for a reward to see."""
    from nnx_cli.decoding import text_of

    out = []
    for ids, n, stopped in zip(drawn["completions"], drawn["lengths"], drawn["stopped"]):
        kept = [int(t) for t in ids[: int(n) - int(stopped)]]
        if hasattr(tokenizer, "decode_all"):
            out.append(tokenizer.decode_all(kept, skip_special_tokens=True))
        else:
            out.append(text_of(tokenizer, kept))  # the bytes tokenizer: no special token but its end of document
    return out


class Rollouts:
    """Sampling and scoring for one run (`exp`, an `experiment.Experiment` with the grpo objective; `steps`, the
    training step and state accessors, `objectives.Steps`)."""

    def __init__(self, exp: Any, steps: Any):
        from nnx_cli.data.tokenizers import load_tokenizer, stop_ids

        self.exp = exp
        self.steps = steps
        self.objective = exp.objective
        self.options = exp.objective.options
        self.tokenizer = load_tokenizer(exp.cfg.data.tokenizer, exp.cfg.model.pretrained)
        self.stop_ids = stop_ids(self.tokenizer, chat=True)  # its eos_token too, as TRL stops
        self._sample = _sampler(exp.moduledef, self.options.max_new_tokens, self.options.temperature, self.stop_ids,
                                steps.stored)  # fmt: skip

    def layout(self, prompts: int, key: str) -> Any:
        """The layout of a batch of `prompts` prompts' completions on the run's mesh (config key `key`)."""
        from nnx_cli import sharding

        n = self.options.num_generations
        rows = prompts * n
        said = f"config key {key!r} ({prompts}) x objective.num_generations ({n}) = {rows} completions"
        return sharding.batch_layout(self.exp.mesh, self.exp.rules, rows, key, said)  # it named the key with {rows}

    def check_context(self, prompt_width: int, what: str) -> None:
        """Prompts `prompt_width` tokens wide and their completions fit the model's positions (learned ones end);
        a UserError naming `what` otherwise."""
        model = self.exp.moduledef.merge(*self.steps.model_states(self.exp.abstract))
        limit, need = model.context_limit, prompt_width + self.options.max_new_tokens - 1
        if limit is not None and need > limit:
            raise UserError(
                f"{what}: prompts of up to {prompt_width} tokens and completions of objective.max_new_tokens "
                f"({self.options.max_new_tokens}) need {need} positions, more than the model's {limit}; lower "
                "data.seq_len (it caps the prompts) or objective.max_new_tokens"
            )

    def draw(self, state: TrainState, prompts: dict[str, np.ndarray], key: jax.Array, layout: Any
             ) -> dict[str, np.ndarray]:  # fmt: skip
        """`num_generations` completions of each prompt (`tokens` `[B, P]`, `lengths` `[B]`), the completions of a
        prompt consecutive rows; with the prompts repeated, on the host."""
        g = self.options.num_generations
        repeated = {
            "tokens": np.repeat(np.asarray(prompts["tokens"], np.int32), g, axis=0),
            "lengths": np.repeat(np.asarray(prompts["lengths"], np.int32), g, axis=0),
        }
        placed = layout.place(repeated)
        drawn = self._sample(self.steps.model_states(state, bits=True), placed["tokens"], placed["lengths"], key)
        return {**jax.device_get(drawn), "prompts": repeated["tokens"], "prompt_lengths": repeated["lengths"]}

    def texts(self, drawn: dict[str, np.ndarray]) -> list[str]:
        return completion_texts(self.tokenizer, drawn)

    def score(self, prompts: list[Any], columns: dict[str, list[Any]], texts: list[str], when: str) -> np.ndarray:
        """The reward functions' values `[N, F]` for completions `texts` of `prompts` (each `num_generations`
        times in a row; `columns`, the rows' other columns, aligned with `prompts`)."""
        g = self.options.num_generations
        repeat = lambda values: [v for v in values for _ in range(g)]  # noqa: E731
        return reward_functions.score(
            self.objective.rewards, repeat(prompts), texts, {k: repeat(v) for k, v in columns.items()}, when
        )


# Training: the loop's feed and dispatch
# ------------------------------------------------------------------------------


def train_round(steps: Any, moduledef: nnx.ModuleDef, tx: Any, objective: Any, seed: int, accum: int,
                state: TrainState, sums: dict[str, Any], rows: dict[str, Any]) -> tuple:  # fmt: skip
    """`objective.steps_per_batch` optimizer steps on the same completions (`steps.train_step`); jit it. With more
    than one, the log-probabilities of the policy that sampled are taken first (`old_logps`)."""
    iterations = objective.steps_per_batch
    if iterations > 1:
        rows = {**rows, "old_logps": objective.old_logps(moduledef.merge(*steps.model_states(state)), rows)}

    def body(carry: tuple, _: Any) -> tuple:
        state, sums, _ = steps.train_step(moduledef, tx, objective, seed, *carry, rows, accum)
        return (state, sums), None

    (state, sums), _ = jax.lax.scan(body, (state, sums), None, length=iterations)
    return state, sums, steps.all_finite(state["params"])


class Dispatch:
    """The training loop's dispatch for GRPO: for each batch of prompts of a dispatch, sample, score, train."""

    def __init__(self, exp: Any, steps: Any):
        from nnx_cli.data import pipeline

        self.exp = exp
        self.rollouts = Rollouts(exp, steps)
        self.keys = pipeline.BatchKeys(exp.train, exp.cfg.train.batch_size)
        self.layout = self.rollouts.layout(exp.cfg.train.batch_size, "train.batch_size")
        self.rollouts.check_context(exp.train.width, "the training prompts")
        scalar = jax.sharding.NamedSharding(exp.mesh, jax.sharding.PartitionSpec())
        fn = functools.partial(
            train_round, steps, exp.moduledef, exp.tx, exp.objective, exp.cfg.seed, exp.cfg.train.grad_accum_steps
        )
        self._round = jax.jit(
            fn,
            in_shardings=(exp.shardings, scalar, self.layout.sharding),
            out_shardings=(exp.shardings, scalar, scalar),
            donate_argnums=(0, 1),
        )

    def __call__(self, state: TrainState, sums: dict[str, Any], step: int) -> tuple:
        """The `steps_per_batch` steps from `step` (a multiple of it): its batch of prompts is batch
        `step // steps_per_batch` of the epoch order."""
        n = self.exp.objective.steps_per_batch
        keys = self.keys.step(step // n)
        drawn = self.rollouts.draw(
            state, self.exp.train.read(keys), stream_key(self.exp.cfg.seed, _SAMPLE, step), self.layout
        )
        prompts, columns = self.exp.train.columns(keys)
        texts = self.rollouts.texts(drawn)
        per_function = self.rollouts.score(prompts, columns, texts, f"at step {step + 1}")
        rows = self.layout.place(self.exp.objective.rows(drawn, per_function))
        return self._round(state, sums, rows)


def inputs(exp: Any, plan: list[tuple[int, int]], steps: Any) -> tuple[Iterator[tuple[int, int]], Any]:
    """The loop's feed (`(steps, first step)` per dispatch: one batch of completions each) and dispatch (`steps`:
    the training step, `objectives.Steps`)."""
    n = exp.objective.steps_per_batch
    for step, k in plan:
        if step % n or k != n:
            raise ValueError(f"a GRPO dispatch is {n} steps from a multiple of {n}; got {k} from step {step}")
    return ((k, step) for step, k in plan), Dispatch(exp, steps)


# Evaluation and samples
# ------------------------------------------------------------------------------


def evaluator(exp: Any, steps: Any) -> Any:
    """`state -> eval metrics`: completions of every eval prompt (or the first `train.eval_max_batches`
    batches), drawn with keys from the batch's index, scored: `reward`, `reward_std`, `reward/NAME`,
    `completion_length`."""
    rollouts = Rollouts(exp, steps)
    size = _eval_size(exp)[0]
    layout = rollouts.layout(*_eval_size(exp))
    rollouts.check_context(exp.eval.width, "the eval prompts")
    limit = exp.cfg.train.eval_max_batches
    g = rollouts.options.num_generations

    def run(state: TrainState) -> dict[str, float]:
        step = int(jax.device_get(state["step"]))
        scores, lengths = [], []
        for i, batch in enumerate(exp.eval.eval_batches(size)):
            if limit is not None and i >= limit:
                break
            drawn = rollouts.draw(state, batch, stream_key(exp.cfg.seed, _EVAL_SAMPLE, i), layout)
            real = np.repeat(batch["mask"], g)
            drawn = {k: v[real] for k, v in drawn.items()}
            prompts, columns = exp.eval.columns(batch["index"][batch["mask"]])
            scores.append(rollouts.score(prompts, columns, rollouts.texts(drawn), f"evaluating step {step}"))
            lengths.append(drawn["lengths"])
        return exp.objective.reward_metrics(np.concatenate(scores), np.concatenate(lengths))

    return run


class Samples:
    """`samples/<step>.txt` with each eval: the first eval prompts, each with its `num_generations` completions
    and their rewards, as the eval drew them (the first eval batch, with its keys)."""

    phase = "eval"

    def __init__(self, every: int, exp: Any, directory: Path | None, guard: Any, steps: Any):
        self.every = every
        self.exp = exp
        self.directory = directory  # None on every process but the first
        self.guard = guard
        self.rollouts = Rollouts(exp, steps)
        self.size = _eval_size(exp)[0]
        self.layout = self.rollouts.layout(*_eval_size(exp))
        self.done: int | None = None

    def __call__(self, loop: Any) -> None:
        from nnx_cli.decoding import text_of

        self.guard.check(loop)
        batch = next(self.exp.eval.eval_batches(self.size))
        shown = min(SHOWN_PROMPTS, int(batch["mask"].sum()))
        g = self.rollouts.options.num_generations
        drawn = self.rollouts.draw(loop.state, batch, stream_key(self.exp.cfg.seed, _EVAL_SAMPLE, 0), self.layout)
        drawn = {k: v[: shown * g] for k, v in drawn.items()}
        prompts, columns = self.exp.eval.columns(batch["index"][:shown])
        texts = self.rollouts.texts(drawn)
        per_function = self.rollouts.score(prompts, columns, texts, f"writing the samples of step {loop.step}")
        total = self.exp.objective.total_rewards(per_function)
        names = self.exp.objective.reward_names
        blocks = []
        for i in range(shown):
            prompt = drawn["prompts"][i * g][: drawn["prompt_lengths"][i * g]]
            blocks.append(f"--- prompt {i}\n{text_of(self.rollouts.tokenizer, prompt.tolist())}\n")
            for j in range(i * g, (i + 1) * g):
                each = ", ".join(f"{n} {_show(v)}" for n, v in zip(names, per_function[j]))
                blocks.append(f"--- completion {i}.{j - i * g}: reward {_show(total[j])} ({each})\n{texts[j]}\n")
        if self.directory is not None:
            path = self.directory / f"{loop.step}.txt"
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(path.name + ".partial")
            partial.write_text("\n".join(blocks))
            partial.replace(path)
        self.done = loop.step

    def end(self, loop: Any) -> None:
        if loop.stop_signal is None and self.done != loop.step:
            self(loop)


def _eval_size(exp: Any) -> tuple[int, str]:
    """Prompts per eval batch, and the config key that says so."""
    if exp.cfg.train.eval_batch_size:
        return exp.cfg.train.eval_batch_size, "train.eval_batch_size"
    return exp.cfg.train.batch_size, "train.batch_size"


def _show(value: float) -> str:
    return "none" if np.isnan(value) else f"{value:.3f}"
