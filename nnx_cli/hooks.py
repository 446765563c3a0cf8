"""What the training loop does between dispatches: each a small hook with an interval (`nnx_cli.loop.Hook`).

- :class:`LogMetrics`   every `train.log_every`: mean train metrics, learning rate, gradient norm, speed -> loggers
- :class:`Checkpoint`   every `checkpoint.every_steps`, and at the end: the state and the loop's sums -> Orbax
- :class:`Evaluate`     every `train.eval_every`, and at the end: eval metrics -> loggers
- :class:`KeepBest`     with each eval, `checkpoint.keep_best`: the best step, kept
- :class:`Samples`      with each eval, for language models: continuations of fixed prompts (`train.sample_tokens`)
- :class:`HarnessEval`  every `eval.harness.every_steps`, and at the end: lm-evaluation-harness tasks -> loggers
- :class:`ImageGrid`    with each eval, for image models: a PNG of inputs, reconstructions and samples
- :class:`Tick`         every dispatch: the live progress bar moves
- :class:`StopVote`     every dispatch (every ~10 steps across processes): Ctrl-C / SIGTERM ends the run
- :class:`Profile`      `train.profile`: a JAX profiler trace of a few steps into the work dir

Before a checkpoint or an eval, :class:`Guard` makes sure the loss and the
parameters are finite (a `RunError` naming the step and the last good
checkpoint otherwise), so only finite states are saved or evaluated.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from nnx_cli import optim, steps
from nnx_cli.errors import RunError, UserError, is_out_of_memory, out_of_memory_message
from nnx_cli.loop import Loop

EVAL_PROMPTS = 2  # prompts of the samples written at each eval when `train.sample_prompts` names none


class Guard:
    """Stops the run once the loss, or the parameters, are not finite; names the last good checkpoint."""

    def __init__(self, checkpointer: Any, directory: Path):
        self.checkpointer = checkpointer
        self.directory = directory  # the checkpoints dir as the user named it
        self._params_finite = jax.jit(steps.all_finite)
        self._checked: tuple[int, bool] | None = None

    def check(self, loop: Loop, *, params: bool = True) -> None:
        if self._checked is not None and self._checked[0] == loop.step and (self._checked[1] or not params):
            return  # already checked at this step (a checkpoint and an eval at the same step)
        self.check_loss(int(jax.device_get(loop.sums["bad_step"])), loop.step)
        finite = loop.finite if loop.finite is not None else self._params_finite(loop.state["params"])
        if params and not bool(finite):
            self.fail(f"the parameters are non-finite at step {loop.step}", loop.step)
        self._checked = (loop.step, params)

    def check_loss(self, bad: int, step: int) -> None:
        """Stop the run if the loop's sums name a step whose loss was non-finite (`bad` >= 0, 0-based)."""
        if bad >= 0:  # the loss of step bad + 1 is computed from the parameters of step `bad`
            self.fail(f"the loss became non-finite at step {bad + 1}", step, gave_it=bad)

    def fail(self, what: str, step: int, gave_it: int | None = None) -> None:
        """Stop the run saying `what` and the last good checkpoint. `gave_it`: the step whose parameters gave a
        non-finite loss; a checkpoint of that step is finite but no good (resuming from it fails again), so the
        one before it is named, and it is said how to resume from there."""
        from nnx_cli import integrity

        self.checkpointer.wait()
        last, _ = integrity.newest_intact(self.checkpointer.directory)
        where = self.directory
        kept = f"the last good checkpoint is {where / str(last)}" if last is not None else "no checkpoint was written"
        if last is not None and last == gave_it:
            intact, _ = integrity.newest_intact(self.checkpointer.directory, below=last)
            kept = f"the checkpoint {where / str(last)} holds the parameters that gave that loss, and " + (
                f"the last good checkpoint is {where / str(intact)} (move {where / str(last)} out of {where} to "
                "resume from it, with a lower optimizer.learning_rate or an optimizer.clip_grad_norm)"
                if intact is not None
                else "there is no checkpoint before it"
            )
        raise RunError(f"{what} (training stopped at step {step}); {kept}")


class LogMetrics:
    """Mean train metrics since the last log, with the learning rate, gradient norm and speed."""

    def __init__(self, every: int, loggers: Any, guard: Guard, *, batch_size: int, tokens_per_example: int = 0):
        self.every = every
        self.loggers = loggers
        self.guard = guard
        self.batch_size = batch_size
        self.tokens_per_example = tokens_per_example
        self._last: tuple[int, float, float] | None = None  # (step, time, seconds not training) of the last log
        self._created = time.perf_counter(), _not_training()  # the first interval starts here

    def __call__(self, loop: Loop) -> None:
        self._report(loop, restart=True)

    def end(self, loop: Loop) -> None:
        """The steps since the last log. On the interval (a run whose length is a multiple of it) that is a
        regular record, which a resumed run keeps: the sums start again, as after any log. Off it, a resumed run
        drops the record, and the sums stay (the final checkpoint keeps them) to be counted in its next one."""
        self._report(loop, restart=loop.step % self.every == 0)

    def _report(self, loop: Loop, restart: bool) -> None:
        """Log the mean train metrics since the last log; with `restart`, the sums start again once the record is
        in the loggers' hands, even when one of them fails with it (the step's rescue checkpoint then holds the
        sums a resumed run, which keeps the record, counts from)."""
        host = jax.device_get(loop.sums)
        count = int(host["count"])
        if count == 0:
            return
        self.guard.check_loss(int(host["bad_step"]), loop.step)
        metrics = {k: float(v) / count for k, v in host["metrics"].items()}
        metrics["learning_rate"] = optim.learning_rate_at(loop.exp.schedule, loop.step - 1)
        metrics["grad_norm"] = float(host["grad_norm"]) / count
        now, aside = time.perf_counter(), _not_training()
        last_step, last_time, last_aside = self._last or (loop.start, *self._created)
        running = (now - last_time) - (aside - last_aside)  # the speed of the steps, not of compiling or evals
        if loop.step > last_step and running > 0:
            rate = (loop.step - last_step) / running
            metrics["steps_per_s"] = rate
            metrics["examples_per_s"] = rate * self.batch_size
            if self.tokens_per_example:
                metrics["tokens_per_s"] = rate * self.batch_size * self.tokens_per_example
        self._last = (loop.step, now, aside)
        metrics.update(_device_memory())
        try:
            self.loggers.log(loop.step, "train", metrics)
        finally:
            if restart:
                loop.sums = loop.exp.empty_sums()


def _not_training() -> float:
    """Seconds this process has spent so far compiling (JAX's monitoring events), evaluating and writing
    checkpoints (the hooks' phases): :data:`runtime.PHASES`."""
    from nnx_cli.runtime import PHASES

    return sum(PHASES.seconds.get(phase, 0.0) for phase in ("compile", "eval", "checkpoint"))


class Checkpoint:
    """Saves the train state and the loop's running sums every `every` steps, and at the end."""

    phase = "checkpoint"

    def __init__(self, every: int, checkpointer: Any, guard: Guard, saved: int | None = None, base: dict | None = None):
        self.every = every
        self.checkpointer = checkpointer
        self.guard = guard
        self.saved = saved
        self.base = base  # an adapter run's base model and its weights' checksums, kept in each manifest
        self.saves = 0  # checkpoints this run has written
        self.first_at_stop = False  # this run's first checkpoint is the one a signal's stop wrote

    def __call__(self, loop: Loop) -> None:
        if self.saved == loop.step:  # saved already (keep_best saves its step before the checkpoint hook runs)
            return
        self.guard.check(loop)
        self.checkpointer.save(loop.step, steps.trainable(loop.state), loop=loop.sums, base=self.base)
        self.saved = loop.step
        self.saves += 1

    def end(self, loop: Loop) -> None:
        self.guard.check(loop)
        self.first_at_stop = loop.stop_signal is not None and self.saves == 0
        self(loop)
        self.checkpointer.wait()

    def rescue(self, loop: Loop) -> None:
        """Another hook failed at this step (an eval, say, before this step's checkpoint): save the step if its
        loss and parameters are finite, and say so, then let the failure end the run; a save that fails instead
        is the error reported. One process only: on several, a save is collective, and the others may not have
        failed."""
        if jax.process_count() > 1:
            return
        self.checkpointer.wait()  # an earlier save that failed (a full disk) is the error to report: it names the loss
        if self.saved == loop.step:
            return
        try:
            self.guard.check(loop)
        except Exception:
            return  # parameters that are not finite are no step to keep; the failure that brought us here is reported
        self(loop)
        self.checkpointer.wait()
        print(f"checkpoint written at {self.guard.directory / str(loop.step)} before stopping", file=sys.stderr,
              flush=True)  # fmt: skip


class Evaluate:
    """Eval metrics over the eval split every `every` steps and at the end (not after a signal stopped the run)."""

    phase = "eval"

    def __init__(self, every: int, evaluator: Any, loggers: Any, guard: Guard):
        self.every = every
        self.evaluator = evaluator
        self.loggers = loggers
        self.guard = guard
        self.done: int | None = None
        self.metrics: dict[str, float] = {}

    def __call__(self, loop: Loop) -> None:
        self.guard.check(loop)
        self.metrics = self.evaluator(loop.state)
        self.loggers.log(loop.step, "eval", self.metrics)
        self.done = loop.step

    def end(self, loop: Loop) -> None:
        if loop.stop_signal is None and self.done != loop.step:
            self(loop)


class KeepBest:
    """`checkpoint.keep_best`: after each eval, a better value of the metric makes that step the best one:
    checkpointed (if it was not), recorded in `checkpoints/best.json`, never removed by the keep-N cleanup. A step
    checkpointed for that alone does not count among `checkpoint.keep`'s newest, and goes once bettered."""

    phase = "checkpoint"

    def __init__(self, evaluate: Evaluate, checkpoint: Checkpoint, metric: str, mode: str, start: int):
        from nnx_cli.workdir import best_record

        self.every = evaluate.every
        self.evaluate, self.checkpoint = evaluate, checkpoint
        self.metric, self.mode = metric, mode
        self.directory = checkpoint.guard.directory
        record = best_record(self.directory)
        self.best = record if record and record.get("metric") == metric and record["step"] <= start else None
        if self.best is not None:
            checkpoint.checkpointer.protect = {self.best["step"]}
            if self.best.get("only_for_best"):
                checkpoint.checkpointer.passed_over.add(self.best["step"])

    def __call__(self, loop: Loop) -> None:
        from nnx_cli.workdir import write_best

        value = self.evaluate.metrics.get(self.metric) if self.evaluate.done == loop.step else None
        if value is None or not math.isfinite(value):  # a NaN is no best: every later value compared false to it
            return
        if self.best is not None and not self._better(value, self.best["value"]):
            return
        # a step saved for being the best alone (not a checkpoint.every_steps step, nor the last) is no periodic
        # checkpoint: once bettered it goes, rather than take the place of one among checkpoint.keep's newest
        only_for_best = (
            self.checkpoint.saved != loop.step and loop.step % self.checkpoint.every and (loop.step != loop.total)
        )
        self.checkpoint(loop)  # saves this step unless it is saved already
        if only_for_best:  # kept while the best (protected), then pruned as any step beyond checkpoint.keep's newest
            self.checkpoint.checkpointer.passed_over.add(loop.step)
        self.best = {"step": loop.step, "metric": self.metric, "mode": self.mode, "value": value,
                     "only_for_best": bool(only_for_best)}  # fmt: skip
        self.checkpoint.checkpointer.protect = {loop.step}
        if jax.process_index() == 0:
            write_best(self.directory, self.best)

    def _better(self, value: float, best: float) -> bool:
        return value < best if self.mode == "min" else value > best

    def end(self, loop: Loop) -> None:
        if self.evaluate.done == loop.step:
            self(loop)


class ImageGrid:
    """A PNG grid of the model's `images` (inputs, reconstructions, samples) with each eval."""

    phase = "eval"

    def __init__(self, every: int, make_images: Any, directory: Path | None, guard: Guard):
        self.every = every
        self.make_images = make_images
        self.directory = directory  # None on every process but the first
        self.guard = guard
        self.done: int | None = None

    def __call__(self, loop: Loop) -> None:
        from nnx_cli.report import write_image_grid

        self.guard.check(loop)
        images = self.make_images(loop.state)  # every process computes (the arrays span all of them)
        if self.directory is not None:
            write_image_grid(images, self.directory / f"{loop.step}.png")
        self.done = loop.step

    def end(self, loop: Loop) -> None:
        if loop.stop_signal is None and self.done != loop.step:
            self(loop)


class Samples:
    """Language models: continuations of fixed prompts, `train.sample_tokens` tokens at most, written to
    `samples/<step>.txt` with each eval, drawn with keys from `(seed, step)`, so a resumed run writes the same
    samples as an uninterrupted one."""

    phase = "eval"

    def __init__(self, every: int, exp: Any, directory: Path | None, guard: Guard, prompts: list[list[int]]):
        from nnx_cli.data.tokenizers import load_tokenizer

        self.every = every
        self.exp = exp
        self.directory = directory  # None on every process but the first
        self.guard = guard
        self.prompts = prompts  # eval_prompts(exp), checked before the work dir was touched
        self.tokenizer = load_tokenizer(exp.cfg.data.tokenizer, exp.cfg.model.pretrained)
        self.done: int | None = None

    def __call__(self, loop: Loop) -> None:
        from nnx_cli.decoding import Decoder
        from nnx_cli.lm import eval_sample_stops

        self.guard.check(loop)
        decoder = Decoder(self.exp.moduledef, steps.parameters(loop.state))
        key = jax.random.fold_in(jax.random.key(self.exp.cfg.seed), loop.step)
        tokens = self.exp.cfg.train.sample_tokens
        try:
            drawn = decoder.generate(
                self.prompts, max_tokens=tokens, seed=key, **eval_sample_stops(self.exp.cfg.data.format, self.tokenizer)
            ).finish()
        except Exception as e:  # the advice for the training step (batch size, remat) does not apply here
            if not is_out_of_memory(e):
                raise
            longest = max(len(p) for p in self.prompts)
            raise RunError(out_of_memory_message(e, (
                f"the eval's samples need a key-value cache of {len(self.prompts)} x ({longest} prompt + {tokens} new) "
                "positions in every layer: lower train.sample_tokens (0 writes none), or give fewer or shorter "
                "train.sample_prompts"
            ))) from None  # fmt: skip
        if self.directory is not None:
            write_eval_samples(self.directory / f"{loop.step}.txt", self.prompts, drawn, self.tokenizer)
        self.done = loop.step

    def end(self, loop: Loop) -> None:
        if loop.stop_signal is None and self.done != loop.step:
            self(loop)


def eval_prompts(exp: Any) -> list[list[int]]:
    """The prompts of the samples written at each eval: `train.sample_prompts`, encoded (a run on conversations,
    chats or conversational preference pairs, renders each as a user turn and the opening of the reply, as
    `nnx-generate --chat` does); by default the first tokens of the eval split and of its middle."""
    from nnx_cli.data import examples
    from nnx_cli.data.tokenizers import load_tokenizer
    from nnx_cli.lm import encode_prompt, run_chat_template

    if exp.cfg.train.sample_prompts:
        chat = examples.is_conversational(exp.cfg.data)
        tokenizer = load_tokenizer(exp.cfg.data.tokenizer, exp.cfg.model.pretrained)
        template = run_chat_template(exp.cfg, tokenizer) if chat else None
        prompts = []
        for i, text in enumerate(exp.cfg.train.sample_prompts):
            key = f"config key 'train.sample_prompts': prompt {i} ({text!r})"
            if not text.isascii() and not _encodes(text):
                raise UserError(f"{key} is not UTF-8 text (a lone surrogate, half of a character written as \\ud800); "
                                "write the whole character")  # fmt: skip
            try:
                prompts.append(encode_prompt(tokenizer, text, chat, None, template))
            except UserError as e:
                if "encodes to no tokens" not in str(e):  # a chat template that failed on it, say
                    raise UserError(f"{key}: {e}") from None
                raise UserError(f"{key} encodes to no tokens; give it some text") from None
        return prompts
    if examples.is_examples(exp.cfg.data):  # the start of eval examples, up to where their first answer begins
        rows = exp.eval.stored()
        prompts = []
        for row in sorted({0, len(rows["tokens"]) // 2})[:EVAL_PROMPTS]:
            first = rows["segments"][row] == 1
            answer = np.flatnonzero(first & (rows["targets"][row] > 0))
            end = int(answer[0]) if len(answer) else int(first.sum())
            prompts.append([int(t) for t in rows["tokens"][row][: max(end, 1)]])
        return prompts
    stream = exp.eval.stored()["tokens"]
    eod = load_tokenizer(exp.cfg.data.tokenizer, exp.cfg.model.pretrained).eod_id
    length = max(1, min(32, exp.cfg.data.seq_len // 4))
    starts = [0, len(stream) // 2][:EVAL_PROMPTS]
    return [prompt for s in starts if (prompt := _text_prompt(stream, s, length, eod))]


def _encodes(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _text_prompt(stream: np.ndarray, start: int, length: int, eod: int) -> list[int]:
    """Up to `length` tokens of one document from `start` on, end-of-document tokens skipped and never crossed (a
    prompt running into the next document, or made of empty ones, held the end-of-document token, which is no
    text); where `start` may be too near its document's end for a whole prompt, the next document's beginning."""
    at = _next_text(stream, start, eod)
    if at is None:
        return []
    piece = _to_document_end(stream, at, length, eod)
    if len(piece) < length and not (at > 0 and stream[at - 1] == eod):  # a held-out split starts mid-document
        following = _next_text(stream, at + len(piece), eod)
        if following is not None:
            piece = _to_document_end(stream, following, length, eod)
    return [int(t) for t in piece]


def _to_document_end(stream: np.ndarray, at: int, length: int, eod: int) -> np.ndarray:
    piece = np.asarray(stream[at : at + length])
    ends = np.flatnonzero(piece == eod)
    return piece[: ends[0]] if len(ends) else piece


def _next_text(stream: np.ndarray, start: int, eod: int, chunk: int = 1 << 16) -> int | None:
    """The first position from `start` on that holds a token of text (not end-of-document), or None."""
    for at in range(start, len(stream), chunk):
        found = np.flatnonzero(np.asarray(stream[at : at + chunk]) != eod)
        if len(found):
            return at + int(found[0])
    return None


def check_sample_prompts(exp: Any, prompts: list[list[int]]) -> None:
    """`train.sample_prompts` (encoded) that the model's context holds, or a UserError naming the key: found before
    the run starts, not at its first eval."""
    limit = exp.moduledef.merge(*steps.model_states(exp.abstract)).context_limit
    for i, prompt in enumerate(prompts if exp.cfg.train.sample_prompts else []):
        if limit is not None and len(prompt) > limit:
            raise UserError(f"config key 'train.sample_prompts': prompt {i} has {len(prompt)} tokens, more than the "
                            f"model's context of {limit}; shorten it")  # fmt: skip


def write_eval_samples(path: Path, prompts: list[list[int]], drawn: Any, tokenizer: Any) -> None:
    """`samples/<step>.txt`: each prompt and its continuation."""
    from nnx_cli.decoding import text_of

    blocks = []
    for i, (prompt, sample) in enumerate(zip(prompts, drawn.samples)):
        blocks.append(f"--- sample {i}\n{text_of(tokenizer, prompt)}{text_of(tokenizer, sample)}\n")
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text("\n".join(blocks))
    partial.replace(path)


class HarnessEval:
    """`eval.harness`: lm-evaluation-harness tasks (loaded once) on the current parameters every `every` steps and
    at the end (not after a signal stopped the run), their metrics logged as split `harness`
    (`<task>/<metric>`). The model's programs compile at the first one and are reused after."""

    phase = "eval"

    def __init__(self, every: int, exp: Any, tasks: Any, loggers: Any, guard: Guard, workdir: Path):
        self.every = every
        self.exp = exp
        self.tasks = tasks
        self.loggers = loggers
        self.guard = guard
        self.workdir = workdir
        self.options = exp.cfg.eval.harness
        self.lm: Any = None
        self.done: int | None = None

    def __call__(self, loop: Loop) -> None:
        import random

        import numpy as np

        from nnx_cli import harness

        self.guard.check(loop)
        params = steps.parameters(loop.state)
        if self.lm is None:
            from nnx_cli.harness.backend import NNXLM
            from nnx_cli.harness.target import training_target

            target = training_target(self.exp, params, self.workdir, loop.step)
            self.lm = NNXLM(target, batch_size=self.options.batch_size)
        else:
            self.lm.engine.set_params(params)
            self.lm.target.params, self.lm.target.step = params, loop.step
        saved = random.getstate(), np.random.get_state()
        try:
            limit = self.options.limit
            with harness.quiet(), harness.as_config_keys():  # lm-eval's progress bars and notes: the run's console
                # shows the results table; the errors name eval.harness keys
                results = harness.evaluate(
                    self.lm, self.tasks, num_fewshot=self.options.num_fewshot,
                    limit=int(limit) if limit is not None and limit >= 1 else limit,
                    apply_chat_template=self.options.apply_chat_template, bootstrap_iters=0,
                )  # fmt: skip
        finally:  # lm-eval seeds Python's and NumPy's global generators: the run's are left as they were
            random.setstate(saved[0])
            np.random.set_state(saved[1])
            # not held until the next evaluation: a frozen base the state holds as bits is a copy here
            self.lm.engine.set_params(None)
            self.lm.target.params = None
        self.loggers.log(loop.step, "harness", harness.flat_metrics(results))
        self.done = loop.step

    def end(self, loop: Loop) -> None:
        if loop.stop_signal is None and self.done != loop.step:
            self(loop)


class FirstStep:
    """Says when the first dispatch was compiled and sent to the devices (no wait for it to finish)."""

    def __init__(self, every: int, say: Any):
        self.every = every
        self.say = say
        self.done = False

    def __call__(self, loop: Loop) -> None:
        from nnx_cli.runtime import PHASES

        if not self.done:
            steps = f"step {loop.step}" if loop.step == loop.start + 1 else f"steps {loop.start + 1}-{loop.step}"
            self.say(f"{steps} compiled and running, {PHASES.since_start():.1f} s after start")
            self.done = True

    def end(self, loop: Loop) -> None:
        self(loop)


class Tick:
    """Moves the live progress bar after every dispatch (no device sync)."""

    def __init__(self, every: int, loggers: Any):
        self.every = every
        self.loggers = loggers

    def __call__(self, loop: Loop) -> None:
        self.loggers.tick(loop.step)

    def end(self, loop: Loop) -> None:
        pass


class StopVote:
    """Ends the run after the current dispatch once Ctrl-C, SIGTERM or SIGHUP arrived (agreed by every process)."""

    def __init__(self, every: int, signals: Any):
        self.every = every
        self.signals = signals

    def __call__(self, loop: Loop) -> None:
        if self.signals.agreed():
            loop.stop_signal = self.signals.signal

    def end(self, loop: Loop) -> None:
        pass


class Profile:
    """`train.profile: [start, n]`: a JAX profiler trace of steps `start` to `start + n` into `directory`: of the
    whole dispatches (`every` steps each) that hold them, begun between dispatches (it traced nothing when the
    window fell inside one)."""

    def __init__(self, every: int, start: int, steps: int, directory: Path):
        self.every = every
        self.first, self.last = start, start + steps
        self.directory = directory
        self.active = False

    def begin(self, loop: Loop) -> None:
        """Before the first dispatch: a window that starts in it is traced from there."""
        self(loop)

    def __call__(self, loop: Loop) -> None:
        upcoming = (loop.step, loop.step + self.every)  # the steps the next dispatch runs
        if not self.active and upcoming[0] < self.last and upcoming[1] > self.first:
            jax.profiler.start_trace(str(self.directory))
            self.active = True
            if jax.process_index() == 0:
                print(f"profiling from step {loop.step} to the end of the dispatch that reaches step "
                      f"{min(self.last, loop.total)}, into {self.directory}", file=sys.stderr, flush=True)  # fmt: skip
        elif self.active and loop.step >= self.last:
            self.end(loop)

    def end(self, loop: Loop) -> None:
        if self.active:
            jax.block_until_ready(loop.state)
            jax.profiler.stop_trace()
            self.active = False


def _device_memory() -> dict[str, float]:
    """`device_memory_gb`: the most memory in use on one of this process's devices, and `device_peak_gb` the
    most it has used since it started, where the platform says (a GPU does, a CPU does not)."""
    out = {}
    for metric, stat in (("device_memory_gb", "bytes_in_use"), ("device_peak_gb", "peak_bytes_in_use")):
        known = [b for d in jax.local_devices() if (b := (d.memory_stats() or {}).get(stat)) is not None]
        if known:
            out[metric] = max(known) / 2**30
    return out


def evaluator(exp: Any, layout: Any, scalar: Any) -> Any:
    """`state -> eval metrics` over the eval split (or its first `train.eval_max_batches` batches); an objective that
    evaluates by sampling gives its own (`layout` unused)."""
    from nnx_cli.data import pipeline
    from nnx_cli.experiment import reports_perplexity

    if hasattr(exp.objective, "evaluator"):  # an objective that evaluates by sampling (GRPO's rewards)
        return exp.objective.evaluator(exp, steps)
    fn = functools.partial(steps.eval_step, exp.moduledef, exp.cfg.seed, exp.eval.prepare, objective=exp.objective)
    eval_step = jax.jit(fn, in_shardings=(exp.shardings, layout.sharding, scalar, scalar), out_shardings=scalar)
    limit = exp.cfg.train.eval_max_batches
    count = eval_count(exp, layout)

    def run(state: steps.TrainState) -> dict[str, float]:
        batches = pipeline.eval_feed(exp.eval, layout, limit)
        metrics = steps.evaluate(eval_step, state, batches, count, exp.eval_zeros())
        if reports_perplexity(exp.cfg, exp.spec) and "loss" in metrics:
            metrics["perplexity"] = math.exp(min(metrics["loss"], 700.0))  # the language models' usual figure
        return metrics

    return run


def eval_count(exp: Any, layout: Any) -> int:
    """The rows an eval reads: the eval split, or its first `train.eval_max_batches` batches of `layout.size`."""
    limit = exp.cfg.train.eval_max_batches
    return len(exp.eval) if limit is None else min(len(exp.eval), limit * layout.size)


def image_maker(exp: Any, layout: Any, scalar: Any) -> Any:
    """`state -> images` of the first eval batch, as a numpy array on every process."""
    fn = functools.partial(steps.images_step, exp.moduledef, exp.cfg.seed, exp.eval.prepare)
    images_step = jax.jit(fn, out_shardings=scalar)

    def run(state: steps.TrainState) -> Any:
        first = layout.place(next(exp.eval.eval_batches(layout.size, layout.rows)))
        return jax.device_get(images_step(state, first))

    return run
