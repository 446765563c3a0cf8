"""`grpo`: group relative policy optimisation (Shao et al., 2024) on computed rewards, with TRL 1.16's losses.

Each step samples `num_generations` completions of every prompt of the batch
(:mod:`nnx_cli.objectives.rollouts`), scores them with the reward functions
(:mod:`nnx_cli.objectives.rewards`) and normalises the rewards within each
prompt's group (spec posttrain.md)::

    R_i = sum_f w_f r_f(i)                        # None rewards left out; all None: no advantage
    A_i = (R_i - mean(R_group)) / (std(R_group) + 1e-4)     # scale_rewards: group (batch: the batch's std; none)

The policy loss is PPO's clipped surrogate per completion token, with the
ratio `rho_t = pi(y_t) / pi_old(y_t)` of the probabilities at the sampling
temperature (`pi_old` is the policy that sampled: the ratio is 1, and only
its gradient counts, unless `num_iterations > 1` reuses the completions)::

    l_t = -min(rho_t A, clip(rho_t, 1 - epsilon, 1 + epsilon_high) A) + beta rho_t k3_t
    k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1               # KL to pi_ref, when beta > 0

(the KL estimate is weighted by the ratio, TRL's default `use_bias_correction_kl`: its gradient is then the
unbiased gradient of the reverse KL, DeepSeek-V3.2; the ratio's value is 1 on-policy, its gradient is not 0)

aggregated over the completion tokens (the end token included) as `loss` says:

- `grpo`: the mean over completions of each completion's mean over its tokens;
- `dr_grpo`: the sum over all tokens divided by completions x `max_new_tokens`;
- `dapo`: the sum over all tokens divided by their number (the whole batch's, also under gradient accumulation).

Metrics: `loss`, `clip_ratio` (the share of tokens whose ratio is clipped on the side its advantage pushes),
`kl` (beta > 0: the mean of rho k3 over tokens), `reward`, `reward_std` (over the batch's completions), `reward/NAME`
(each function's mean where it gave a value) and `completion_length` (tokens, the end token included).

The rows a step trains on (:func:`training_rows`) hold each prompt followed by
one completion, the completion's tokens marked as targets, and what the host
computed per row: `advantages`, and the normalisers that make the trainer's
mean over rows each loss's aggregate (`loss_norm`) and a mean over all tokens
(`token_norm`); the reward metrics, computed once per batch on the host, ride
along in `logged`::

    grpo = GRPO(GRPOOptions(rewards=["my_rewards.correct"]))
    grpo.metrics(model, batch, ctx, reference)      # {"loss": [N], "clip_ratio": [N], "reward": [N], ...}
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

import nnx
from nnx_cli.config import Config
from nnx_cli.errors import UserError
from nnx_cli.objectives import rewards as reward_functions

Batch = dict[str, Any]
PROMPT = "prompt"
"""The `data.format` of GRPO's rows."""
STD_EPSILON = 1e-4
"""Added to the standard deviation that divides the advantages (TRL's)."""


# Advantages and the reward metrics (host, numpy)
# ------------------------------------------------------------------------------


def total_rewards(per_function: np.ndarray, weights: Sequence[float]) -> np.ndarray:
    """`R` `[N]`: the weighted sum of each function's rewards `[N, F]` (NaN: None), Nones left out; NaN where
    every function gave None."""
    per_function = np.asarray(per_function, np.float32)
    weighted = per_function * np.asarray(weights, np.float32)[None, :]
    total = np.nansum(weighted, axis=1).astype(np.float32)
    return np.where(np.isnan(per_function).all(axis=1), np.float32(np.nan), total)


def _nanstd(x: np.ndarray, axis: int | None = None) -> np.ndarray:
    """The standard deviation of the values that are not NaN, with Bessel's correction; NaN for fewer than two."""
    count = np.sum(~np.isnan(x), axis=axis)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(x, axis=axis, keepdims=True)
        var = np.nansum((x - mean) ** 2, axis=axis) / (count - 1)
    return np.where(count > 1, np.sqrt(var), np.nan).astype(np.float32)


def group_advantages(rewards: np.ndarray, num_generations: int, scale: str = "group") -> np.ndarray:
    """The advantage of each completion `[N]` from its reward `R` `[N]` (NaN: unscored), the completions of a
    prompt being `num_generations` consecutive rows: `R` less its group's mean, divided by the group's standard
    deviation plus 1e-4 (`scale` group), the batch's (batch) or nothing (none). Unscored completions, and groups
    with fewer than two scores, get 0."""
    rewards = np.asarray(rewards, np.float32)
    grouped = rewards.reshape(-1, num_generations)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.repeat(np.nanmean(grouped, axis=1), num_generations)
    advantages = rewards - mean
    if scale == "group":
        advantages = advantages / (np.repeat(_nanstd(grouped, axis=1), num_generations) + np.float32(STD_EPSILON))
    elif scale == "batch":
        advantages = advantages / (_nanstd(rewards) + np.float32(STD_EPSILON))
    return np.nan_to_num(advantages, nan=0.0).astype(np.float32)


def reward_metrics(per_function: np.ndarray, weights: Sequence[float], names: Sequence[str],
                   lengths: np.ndarray) -> dict[str, float]:  # fmt: skip
    """The logged reward metrics of a batch of completions: `reward` and `reward_std` over the completions with a
    reward, `reward/NAME` per function over those it scored, `completion_length` (tokens, end token included)."""
    per_function = np.asarray(per_function, np.float32)
    total = total_rewards(per_function, weights)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        out = {"reward": float(np.nanmean(total)), "reward_std": float(_nanstd(total))}
        out.update({f"reward/{name}": float(np.nanmean(per_function[:, j])) for j, name in enumerate(names)})
    out["completion_length"] = float(np.mean(lengths))
    return out


# The rows a step trains on (host, numpy)
# ------------------------------------------------------------------------------


def training_rows(prompts: np.ndarray, prompt_lengths: np.ndarray, completions: np.ndarray,
                  completion_lengths: np.ndarray, advantages: np.ndarray, loss_mask: np.ndarray, loss: str,
                  max_new_tokens: int, logged: dict[str, float]) -> Batch:  # fmt: skip
    """Each prompt followed by its completion, as the rows a step trains on.

    `prompts` `[N, P]` (right-padded, `prompt_lengths` real tokens each), `completions` `[N, L]` (`completion_lengths`
    tokens each, the end token included), `loss_mask` `[N]` (False: the completion counts in no loss, e.g. cut
    at `max_new_tokens` under `mask_truncated_completions`). Rows hold `P + L` tokens; the completion's tokens are
    the targets. `loss_norm` divides each row's sum of token losses so that the mean over rows is `loss`'s
    aggregate; `token_norm` does the same for means over all tokens of the batch."""
    n, width = prompts.shape[0], prompts.shape[1] + completions.shape[1]
    tokens = np.zeros((n, width), np.int32)
    targets = np.zeros((n, width), bool)
    segments = np.zeros((n, width), np.int32)
    for i in range(n):
        p, c = int(prompt_lengths[i]), int(completion_lengths[i])
        tokens[i, :p] = prompts[i, :p]
        tokens[i, p : p + c] = completions[i, :c]
        targets[i, p : p + c] = bool(loss_mask[i])
        segments[i, : p + c] = 1
    counted = targets.sum(axis=1).astype(np.float32)
    every = np.float32(max(float(counted.sum()), 1.0) / n)  # tokens per row over the batch
    norm = {"grpo": np.maximum(counted, 1.0), "dr_grpo": np.full(n, max_new_tokens, np.float32)}.get(
        loss, np.full(n, every, np.float32)
    )
    return {
        "tokens": tokens,
        "targets": targets,
        "segments": segments,
        "positions": np.broadcast_to(np.arange(width, dtype=np.int32), (n, width)).copy(),
        "advantages": np.asarray(advantages, np.float32),
        "loss_norm": norm.astype(np.float32),
        "token_norm": np.full(n, every, np.float32),
        "logged": {k: np.full(n, v, np.float32) for k, v in logged.items()},
    }


# The loss (inside the jitted step)
# ------------------------------------------------------------------------------


def token_logps(model: nnx.Module, batch: Batch, ctx: nnx.Context | None, temperature: float) -> jax.Array:
    """`log pi(y_t | y_<t)` at `temperature` of each next token `[N, W - 1]` (their mask is `targets[:, 1:]`)."""
    tokens = jnp.asarray(batch["tokens"], jnp.int32)
    segments = jnp.asarray(batch["segments"], jnp.int32)
    losses, _ = model.token_losses(
        tokens[:, :-1],
        tokens[:, 1:],
        ctx,
        positions=batch["positions"][:, :-1],
        segments=segments[:, :-1],
        temperature=temperature,
    )
    return -losses


def policy_loss(logps: jax.Array, old_logps: jax.Array, ref_logps: jax.Array | None, batch: Batch,
                epsilon: tuple[float, float], beta: float) -> dict[str, jax.Array]:  # fmt: skip
    """Per row: the loss (its tokens' losses summed over `loss_norm`), `clip_ratio` and, with a reference, `kl`
    (summed over `token_norm`: means over all tokens once averaged over rows). See the module docstring."""
    mask = batch["targets"][:, 1:].astype(jnp.float32)
    advantages = batch["advantages"][:, None]
    ratio = jnp.exp(logps - old_logps)
    clipped = jnp.clip(ratio, 1.0 - epsilon[0], 1.0 + epsilon[1])
    per_token = -jnp.minimum(ratio * advantages, clipped * advantages)
    out = {}
    if ref_logps is not None:
        delta = ref_logps - logps
        kl = (jnp.exp(delta) - delta - 1.0) * ratio  # the ratio makes its gradient the unbiased reverse KL's
        per_token = per_token + beta * kl
        out["kl"] = jnp.sum(kl * mask, axis=-1) / batch["token_norm"]
    low = (ratio < 1.0 - epsilon[0]) & (advantages < 0)
    high = (ratio > 1.0 + epsilon[1]) & (advantages > 0)
    out["clip_ratio"] = jnp.sum((low | high) * mask, axis=-1) / batch["token_norm"]
    return {"loss": jnp.sum(per_token * mask, axis=-1) / batch["loss_norm"], **out}


class GRPO:
    """The GRPO objective; see the module docstring. `options` is a `config.objective.GRPOOptions`."""

    name: ClassVar[str] = "grpo"
    data_formats: ClassVar[tuple[str, ...] | None] = (PROMPT,)
    loss_metric = "loss"

    def __init__(self, options: Any, rewards: list[reward_functions.Reward] | None = None):
        self.options = options
        self.needs_reference = options.beta > 0
        self.rewards = rewards if rewards is not None else reward_functions.load(options.rewards)
        self.weights = list(options.reward_weights or [1.0] * len(self.rewards))
        self.epsilon = (options.epsilon, options.epsilon if options.epsilon_high is None else options.epsilon_high)
        self.steps_per_batch = options.num_iterations

    @property
    def reward_names(self) -> list[str]:
        return [r.name for r in self.rewards]

    @property
    def logged_names(self) -> list[str]:
        """The reward metrics computed on the host for each batch."""
        return ["reward", "reward_std", *(f"reward/{n}" for n in self.reward_names), "completion_length"]

    def check(self, cfg: Config, model_cls: type) -> None:
        import jax

        if cfg.data.format != PROMPT:
            raise UserError(
                f"objective grpo samples completions of prompts: set data.format=prompt (rows holding "
                f"{cfg.data.prompt_key!r}, text or chat messages), not {cfg.data.format}"
            )
        if cfg.data.train_on_prompt:
            raise UserError(
                "config key 'data.train_on_prompt' is true, but objective grpo trains on its completions only; drop it"
            )
        for name in ("token_losses", "init_cache", "prefill", "decode"):
            if not callable(getattr(model_cls, name, None)):
                raise UserError(
                    f"objective grpo samples from a language model with a key-value cache (transformer_lm); model "
                    f"{cfg.model.name!r} has no {name}"
                )
        if jax.process_count() > 1:
            raise UserError(
                "objective grpo runs in one process (on any number of its devices); this run has "
                f"{jax.process_count()} processes"
            )
        n = self.options.num_iterations
        if n > 1:
            for key, value in (("train.steps", cfg.train.steps), ("train.log_every", cfg.train.log_every),
                               ("train.eval_every", cfg.train.eval_every),
                               ("checkpoint.every_steps", cfg.checkpoint.every_steps)):  # fmt: skip
                if value is not None and value % n:
                    raise UserError(
                        f"config key {key!r} ({value}) must be a multiple of objective.num_iterations ({n}): each "
                        f"batch of completions trains {n} steps, and logs, evals and checkpoints fall between batches"
                    )

    def check_start(self, step: int) -> None:
        """A run resumed at `step` trains each batch of completions `num_iterations` steps from a multiple of it: a
        step it does not divide (a checkpoint made under another num_iterations) ended in a traceback."""
        n = self.options.num_iterations
        if step % n:
            raise UserError(
                f"this run resumes at step {step}, which objective.num_iterations ({n}) does not divide: each batch of "
                f"completions trains {n} steps from a multiple of {n}; resume with the num_iterations its steps so "
                "far had, or one that divides the step"
            )

    def check_split(self, cfg: Config, split: Any) -> None:
        """Whether the reward functions can be called with the prompt rows' columns (`rewards.check_columns`)."""
        columns = [name for name in split.rows.column_names if name != split.prompt_key]
        reward_functions.check_columns(self.rewards, columns, cfg.data.source)

    def metrics(self, model: nnx.Module, batch: Batch, ctx: nnx.Context, reference: nnx.Module | None) -> Batch:
        """Per row (a completion): loss, clip_ratio, kl (beta > 0) and the reward metrics of its batch."""
        temperature = self.options.temperature
        logps = token_logps(model, batch, ctx, temperature)
        old = batch.get("old_logps")
        old = jax.lax.stop_gradient(logps) if old is None else old
        ref = None
        if self.needs_reference:
            assert reference is not None, "grpo with beta > 0 needs its reference model"
            ref = jax.lax.stop_gradient(token_logps(reference, batch, None, temperature))
        out = policy_loss(logps, old, ref, batch, self.epsilon, self.options.beta)
        return {**out, **batch["logged"]}

    def abstract_batch(self, prompts: int, prompt_width: int) -> Batch:
        """The shapes and dtypes of the rows a step trains on: the completions of `prompts` prompts `prompt_width`
        tokens wide."""
        rows = prompts * self.options.num_generations
        width = prompt_width + self.options.max_new_tokens
        shape = lambda *s, dtype=jnp.float32: jax.ShapeDtypeStruct(s, dtype)  # noqa: E731
        batch = {
            "tokens": shape(rows, width, dtype=jnp.int32),
            "targets": shape(rows, width, dtype=jnp.bool_),
            "segments": shape(rows, width, dtype=jnp.int32),
            "positions": shape(rows, width, dtype=jnp.int32),
            "advantages": shape(rows),
            "loss_norm": shape(rows),
            "token_norm": shape(rows),
            "logged": {name: shape(rows) for name in self.logged_names},
        }
        if self.options.num_iterations > 1:
            batch["old_logps"] = shape(rows, width - 1)
        return batch

    @property
    def eval_metric_names(self) -> list[str]:
        """What evals report: the reward metrics of completions of the eval prompts."""
        return self.logged_names

    def inputs(self, exp: Any, plan: list[tuple[int, int]], steps: Any) -> tuple[Any, Any]:
        """The training loop's feed and dispatch: GRPO samples its own batches (see `rollouts.inputs`); `steps` is
        the training step (`objectives.Steps`)."""
        from nnx_cli.objectives import rollouts

        return rollouts.inputs(exp, plan, steps)

    def evaluator(self, exp: Any, steps: Any) -> Any:
        """`state -> eval metrics` (see `rollouts.evaluator`)."""
        from nnx_cli.objectives import rollouts

        return rollouts.evaluator(exp, steps)

    def samples(self, every: int, exp: Any, directory: Any, guard: Any, steps: Any) -> Any:
        """The hook that writes `samples/<step>.txt`: eval prompts with completions and their rewards."""
        from nnx_cli.objectives import rollouts

        return rollouts.Samples(every, exp, directory, guard, steps)

    # What the rollouts ask of the objective: its arithmetic on their completions and rewards

    def total_rewards(self, per_function: np.ndarray) -> np.ndarray:
        """`R` `[N]` of the rewards `[N, F]` (see :func:`total_rewards`), weighted by `objective.reward_weights`."""
        return total_rewards(per_function, self.weights)

    def reward_metrics(self, per_function: np.ndarray, lengths: np.ndarray) -> dict[str, float]:
        """The logged reward metrics of a batch of completions (see :func:`reward_metrics`)."""
        return reward_metrics(per_function, self.weights, self.reward_names, lengths)

    def rows(self, drawn: dict[str, np.ndarray], per_function: np.ndarray) -> Batch:
        """The rows a step trains on (:func:`training_rows`) from a batch of completions (`drawn`: `prompts`,
        `prompt_lengths`, `completions`, `lengths`, `stopped`) and their rewards `[N, F]`."""
        o = self.options
        advantages = group_advantages(self.total_rewards(per_function), o.num_generations, o.scale_rewards)
        logged = self.reward_metrics(per_function, drawn["lengths"])
        keep = drawn["stopped"] | (not o.mask_truncated_completions)
        return training_rows(
            drawn["prompts"], drawn["prompt_lengths"], drawn["completions"], drawn["lengths"], advantages, keep,
            o.loss, o.max_new_tokens, logged,
        )  # fmt: skip

    def old_logps(self, model: nnx.Module, rows: Batch) -> jax.Array:
        """The log-probabilities of `rows`' tokens under `model`, the policy that sampled them (`num_iterations >
        1` reuses the completions: the ratio is against these)."""
        return jax.lax.stop_gradient(token_logps(model, rows, None, self.options.temperature))
