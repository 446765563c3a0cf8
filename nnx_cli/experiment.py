"""One setup, shared: a config resolved once into everything a run needs.

`nnx-train`, `nnx-eval`, `nnx-inspect` and `nnx-generate` all start here::

    exp = setup(cfg, data="train")     # or "eval", or None (shapes from the config alone)
    exp.model_cls, exp.spec, exp.tx, exp.total_steps
    exp.objective                      # what training minimises (nnx_cli.objectives): sft, dpo, grpo
    exp.moduledef, exp.abstract        # the train state's structure, shapes and dtypes (nothing allocated)
    exp.mesh, exp.rules, exp.shardings # where every array lives
    state = exp.init_state()           # a fresh state, created on the devices in its shardings

Each `_setup_*` step resolves one part of the config and writes back what it
resolved (model options and their defaults, the input shape, the class
count, the optimizer name, the sharding rules), so the config saved with a
run is complete. Everything a config can get wrong is found here, before a
work dir is touched: the model and optimizer are traced through one train
step on shapes alone.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

import nnx
from nnx_cli import data, models, objectives, optim, sharding, steps
from nnx_cli.config import Config
from nnx_cli.data import sources, text
from nnx_cli.data.base import DataSpec, EvalSplit, TrainSplit
from nnx_cli.errors import UserError, did_you_mean, first_line
from nnx_cli.registry import signature
from nnx_cli.runtime import PHASES


@dataclasses.dataclass
class Experiment:
    """What a config resolves to. See the module docstring."""

    cfg: Config
    model_cls: type
    spec: DataSpec
    train: TrainSplit | None  # with data="train"
    eval: EvalSplit | None  # with data="train" or "eval", when the config has an eval split
    total_steps: int | None  # None without training data
    tx: optax.GradientTransformation
    schedule: optim.Schedule
    moduledef: nnx.ModuleDef
    abstract: steps.TrainState
    metric_names: list[str]
    mesh: jax.sharding.Mesh
    rules: list[tuple[str, Any]]
    shardings: Any
    build: Callable[[nnx.Context], nnx.Module]
    pretrained: Any = None  # nnx_cli.hf.Pretrained with `model.pretrained`: where the parameters come from
    weighted: bool = False  # the model weights its metrics' averages (`weight`: per target token)
    objective: Any = None  # nnx_cli.objectives.Objective: what training minimises

    @property
    def loss_metric(self) -> str:
        return self.objective.loss_metric

    @property
    def has_images(self) -> bool:
        return hasattr(self.model_cls, "images") and len(self.spec.input_shape) == 3

    def attention(self) -> str | None:
        """Which attention the model runs on this platform and why, in words (None: the model has none)."""
        model = self.moduledef.merge(*steps.model_states(self.abstract))
        return model.attention_summary() if hasattr(model, "attention_summary") else None

    def restore_target(self) -> Any:
        """The abstract train state carrying its shardings, without frozen parameters: where a checkpoint is
        restored to."""
        return steps.trainable(sharding.with_shardings(self.abstract, self.shardings))

    def with_frozen(self, state: steps.TrainState) -> steps.TrainState:
        """A restored state completed with the frozen parameters adapters adapt (none without adapters): read
        from `model.pretrained`, else drawn as a fresh run draws them (on a CPU, bfloat16 ones held as their bits:
        `steps.frozen_as_bits`)."""
        if steps.FROZEN not in self.abstract:
            return state
        return {**state, steps.FROZEN: steps.frozen_as_bits(self.frozen_params(self.frozen_target()))}

    def with_reference(self, state: steps.TrainState, say: Callable[[str], None]) -> steps.TrainState:
        """A restored state completed with the copy of its starting parameters that the objective's reference
        is (none when the state keeps none): read again from where the run started, `checkpoint.init_from`
        or `model.pretrained`, else drawn from the seed as a fresh run draws them."""
        if steps.REFERENCE not in self.abstract:
            return state
        target = sharding.with_shardings(self.abstract, self.shardings)["params"]
        if self.cfg.checkpoint.init_from is not None:
            params, _, where = self.init_from_params(self.cfg.checkpoint.init_from, say)
            say(f"the reference model is read from {where}, where the run started")
        elif self.pretrained is not None:
            params = self.load_pretrained(target)
        else:
            fresh = lambda: steps.init_state(self.build, self.tx, self.cfg.seed)[1]["params"]  # noqa: E731
            params = steps.jit_drawing(fresh, out_shardings=jax.tree.map(lambda a: a.sharding, target))()
        return {**state, steps.REFERENCE: params}

    def init_from_params(self, source: str, say: Callable[[str], None]) -> tuple[nnx.State, str, str]:
        """`checkpoint.init_from`: the parameters of another run's newest usable step (or the step dir named), or
        the adapters of a PEFT adapter directory, for fine-tuning; with what they are ("parameters", "adapters")
        and where they were read, in words."""
        from pathlib import Path

        from nnx_cli import restore
        from nnx_cli.hf import peft
        from nnx_cli.workdir import open_run

        if peft.is_adapter_dir(source):
            return peft.load(self, Path(source)), "adapters", f"the PEFT adapter {source}"
        try:
            run = open_run(source)
        except UserError as e:
            raise UserError(f"config key 'checkpoint.init_from': {e}") from None
        target = self.restore_target()["params"]
        pick = "point checkpoint.init_from at another step dir, or at the run's work dir for its newest usable step"
        try:
            step, (manifest, params) = restore.from_run(
                run, lambda ckpt, s: (ckpt.manifest(s), ckpt.restore_params(s, target)), say, pick
            )
        except UserError as e:
            raise UserError(f"config key 'checkpoint.init_from': {e}") from None
        where = run.checkpoints / str(step)
        if steps.FROZEN not in self.abstract:
            return params, "parameters", str(where)
        if self.pretrained is not None and "base" in manifest:  # adapters moved to another base: may be meant
            try:
                self.pretrained.check_record(manifest["base"], where)
            except UserError:
                trained_on = manifest["base"].get("source") or manifest["base"].get("pretrained")
                say(f"notice: the adapters of {where} were trained on other base weights ({trained_on}); they start "
                    f"here on those of model.pretrained, {self.pretrained.source}")  # fmt: skip
        else:  # a base drawn from a seed on either side
            drawn = lambda seed: f"a base drawn from seed {seed}"  # noqa: E731
            if "base" in manifest:
                trained_on = manifest["base"].get("source")
            else:  # an older checkpoint without the record says nothing of a base it was trained on
                trained_on = drawn(run.cfg.seed) if run.cfg.model.pretrained is None else None
            here = self.pretrained.source if self.pretrained is not None else drawn(self.cfg.seed)
            if trained_on is not None and trained_on != here:
                say(f"notice: the adapters of {where} were trained on {trained_on}; they start here on {here}")
        return params, "adapters", str(where)

    def frozen_params(self, target: Any) -> nnx.State:
        """The frozen parameters, placed as `target` (abstract, with shardings) says: read from
        `model.pretrained`, else drawn from the seed as a fresh run draws them."""
        if self.pretrained is not None:
            return self.load_pretrained(target)
        fresh = lambda: steps.init_state(self.build, self.tx, self.cfg.seed)[1][steps.FROZEN]  # noqa: E731
        return steps.jit_drawing(fresh, out_shardings=jax.tree.map(lambda a: a.sharding, target))()

    def base_record(self) -> dict[str, Any] | None:
        """What a checkpoint of this run keeps of its base model: for adapters on `model.pretrained`, the
        directory and its weight files' checksums; None otherwise (the checkpoint holds every parameter)."""
        if steps.FROZEN in self.abstract and self.pretrained is not None:
            return self.pretrained.record()
        return None

    def hash_base(self) -> None:
        """Start hashing the base model's files (what :meth:`check_base` compares) on a thread of their own, to be
        done by the time a read-only command has imported Orbax and found its checkpoint."""
        if steps.FROZEN in self.abstract and self.pretrained is not None:
            self.pretrained.hash_files()

    def check_base(self, manifest: dict[str, Any], where: Any) -> None:
        """The base weights are those the adapters of the checkpoint `where` (whose `manifest` this is) were
        trained on; a UserError naming the file otherwise."""
        if self.pretrained is not None and "base" in manifest:
            self.pretrained.check_record(manifest["base"], where)

    def frozen_target(self) -> Any:
        """The abstract parameters `model.pretrained` fills (with their shardings): the frozen ones under adapters,
        else all parameters."""
        target = sharding.with_shardings(self.abstract, self.shardings)
        return target[steps.FROZEN] if steps.FROZEN in target else target["params"]

    def init_state(self) -> steps.TrainState:
        """A fresh train state, created directly on the devices in its shardings; with `model.pretrained`, its
        parameters streamed from the model directory's weights. On a CPU, frozen bfloat16 parameters are held as
        their bits (`steps.frozen_as_bits`)."""
        state = self._fresh_state()
        if steps.FROZEN in state:
            state[steps.FROZEN] = steps.frozen_as_bits(state.pop(steps.FROZEN))
        return state

    def _fresh_state(self) -> steps.TrainState:
        reference = steps.REFERENCE in self.abstract
        if self.pretrained is None:
            fresh = steps.jit_drawing(
                lambda: steps.init_state(self.build, self.tx, self.cfg.seed, reference)[1],
                out_shardings=self.shardings,
            )
            return fresh()
        loaded = self.load_pretrained(self.frozen_target())
        if steps.FROZEN in self.abstract:  # fresh adapters beside the loaded base, which is not passed through a
            # jitted function: it would come out copied whole (XLA cannot take the loader's memory as its own)
            def adapters() -> steps.TrainState:
                return _without(steps.init_state(self.build, self.tx, self.cfg.seed, reference)[1], steps.FROZEN)

            state = steps.jit_drawing(adapters, out_shardings=_without(self.shardings, steps.FROZEN))()
            return {**state, steps.FROZEN: loaded}

        def around(loaded: nnx.State) -> steps.TrainState:  # the random parameters it draws go unused: XLA drops them
            state = steps.init_state(self.build, self.tx, self.cfg.seed, reference)[1]
            extra = {steps.REFERENCE: loaded} if reference else {}
            return {**state, "params": loaded, "opt_state": self.tx.init(loaded), **extra}

        # the loaded weights in XLA's buffers first, one at a time: the donated ones then pass through uncopied
        return steps.jit_drawing(around, out_shardings=self.shardings, donate_argnums=0)(steps.owned(loaded))

    def load_pretrained(self, target: Any = None) -> nnx.State:
        """The parameters of `model.pretrained`, each read into its sharding (`target`: the abstract parameters
        with their shardings; by default :meth:`frozen_target`)."""
        with PHASES("checkpoint"):
            target = target if target is not None else self.frozen_target()
            return self.pretrained.load(target, quantize=self.cfg.model.options.get("quantize"))

    def eval_zeros(self) -> dict[str, Any]:
        """The eval accumulator, zeroed, on the devices: a sum per metric (and of the weights, when weighted)."""
        names = [*self.metric_names, *([steps.WEIGHT] if self.weighted else [])]
        return sharding.put_replicated({k: np.zeros((), np.float32) for k in names}, self.mesh)

    def empty_sums(self) -> dict[str, Any]:
        """The train-metric accumulator, zeroed, on the devices (see `steps.empty_sums`)."""
        return sharding.put_replicated(steps.empty_sums(self.metric_names), self.mesh)

    def steps_per_epoch(self) -> int:
        assert self.train is not None
        return self.train.steps_per_epoch(self.cfg.train.batch_size)


def _without(tree: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in tree.items() if k != key}


def setup(cfg: Config, *, data: str | None = "train", place: bool = True) -> Experiment:
    """Resolve `cfg` once. `data`: "train" (train and eval splits), "eval" (eval split) or None (no data read).
    `place=False` skips the device mesh (`nnx-inspect` shows how a mesh would split the state without it)."""
    text.fill_text_key(cfg.data)  # a .txt / .md file or directory of them: documents in `text`
    if cfg.model.name == "transformer_lm" and cfg.model.pretrained is None and not text.is_text(cfg.data):
        sources.check_local_source(cfg.data.source)  # a misspelt file name is that, not a question of columns
        raise UserError(  # else the data is read as images, and the error is about a missing image column
            f"model.name 'transformer_lm' is a language model, but data.source {cfg.data.source!r} is not read as "
            "text: set data.text_key to the column holding its documents (e.g. data.text_key=text), or "
            "data.format to chat, completion or preference for fine-tuning examples (a .txt or .md source needs "
            "neither)"
        )
    model_cls, pretrained = _setup_model(cfg)
    if data == "train":
        _check_frozen_base(cfg, pretrained is not None)
    optim.build(cfg.optimizer, None)  # a bad optimizer section fails before any data is read or downloaded
    with PHASES("data"):
        train, evals, spec = _setup_data(cfg, data)
    _fill_model_shapes(cfg, model_cls, spec, train, evals)
    objective = objectives.build(cfg, model_cls)
    if (train or evals) is not None and hasattr(objective, "check_split"):  # GRPO: its rewards can read the rows
        objective.check_split(cfg, train or evals)
    total_steps = _total_steps(cfg, train, getattr(objective, "steps_per_batch", 1))
    tx, schedule = _setup_optimizer(cfg, total_steps)
    build = models.model_factory(cfg.model, spec)
    moduledef, abstract = jax.eval_shape(lambda: steps.init_state(build, tx, cfg.seed))
    if _keeps_reference(cfg, objective, abstract):
        abstract = {**abstract, steps.REFERENCE: abstract["params"]}
    metric_names = _check_step(cfg, moduledef, tx, abstract, train or evals, objective) if data is not None else []
    weighted = steps.WEIGHT in metric_names
    metric_names = [name for name in metric_names if name != steps.WEIGHT]
    if data == "train" and evals is not None and hasattr(model_cls, "images") and len(spec.input_shape) == 3:
        _check_images(cfg, moduledef, abstract, evals)
    if data == "train":
        _check_keep_best(cfg, getattr(objective, "eval_metric_names", metric_names), spec, evals)
    rules = sharding.axis_rules(cfg.sharding)
    mesh = sharding.make_mesh(cfg.sharding) if place else None
    shardings = sharding.state_shardings(abstract, mesh, rules) if place else None
    return Experiment(
        cfg,
        model_cls,
        spec,
        train,
        evals,
        total_steps,
        tx,
        schedule,
        moduledef,
        abstract,
        metric_names,
        mesh,
        rules,
        shardings,
        build,
        pretrained,
        weighted,
        objective,
    )


def _setup_model(cfg: Config) -> tuple[type, Any]:
    """The model class, its options checked against the constructor and completed with its defaults; with
    `model.pretrained`, the model directory checked (config.json, every tensor's header, the tokenizer) and its
    options filled in.

    A model that can report `bits_per_byte` does so for the `bytes` tokenizer unless the config says no.
    """
    from nnx_cli import hf

    pretrained = hf.apply_pretrained(cfg)
    model_cls = models.model_class(cfg.model.name)
    byte_level = cfg.data.text_key is not None and cfg.data.format == "text" and cfg.data.tokenizer == "bytes"
    if byte_level and "bits_per_byte" in signature(model_cls).parameters:
        cfg.model.options.setdefault("bits_per_byte", True)
    cfg.model.options = models.resolve_options(cfg.model)
    return model_cls, pretrained


def _check_frozen_base(cfg: Config, pretrained: bool) -> None:
    """A quantised base (`model.quantize`) is a pretrained one whose adapters train: without `model.pretrained` or
    `model.lora`, a UserError."""
    quantize = cfg.model.options.get("quantize")
    if quantize is not None and not pretrained:
        kind = quantize.get("type") if isinstance(quantize, dict) else quantize
        raise UserError(
            f"config key 'model.quantize' stores a pretrained base frozen ({kind}), and model.pretrained is not set: "
            "a base drawn at random would stay random; set model.pretrained, or model.quantize=null to train from "
            "scratch"
        )
    if quantize is not None and cfg.model.options.get("lora") is None:
        kind = quantize.get("type") if isinstance(quantize, dict) else quantize
        raise UserError(
            f"config key 'model.quantize' stores the base model frozen ({kind}), and model.lora is null: a quantised "
            "base cannot be fully fine-tuned; add adapters (e.g. model.lora.rank=16), or set model.quantize=null to "
            "train every weight in full precision"
        )


def _setup_data(cfg: Config, which: str | None) -> tuple[TrainSplit | None, EvalSplit | None, DataSpec]:
    """The splits `which` asks for, and the data spec (from the config alone when no data is read)."""
    if cfg.data.chat_template is not None:  # a template file is kept as its text: the run takes it wherever it goes
        from nnx_cli.data.examples import chat_template

        cfg.data.chat_template = chat_template(cfg.data, None)
    if which is None:
        spec = data.spec_from_config(cfg)
        if spec is None:
            raise UserError(
                f"cannot tell the input shape of data.source {cfg.data.source!r} without reading it: "
                "set model.input_shape (e.g. model.input_shape=[28,28,1]) and, for classifiers, model.num_classes"
            )
        return None, None, spec
    _notice_unread(cfg, which)
    train = data.train_split(cfg) if which == "train" else None
    if which == "eval" and not cfg.data.eval_split:
        raise UserError(
            "config key 'data.eval_split' is null: there is no split to evaluate; pass data.eval_split=<split>"
        )
    evals = data.eval_split(cfg) if cfg.data.eval_split else None
    if train is not None and evals is not None and train.spec.input_shape != evals.spec.input_shape:
        raise UserError(
            f"config key 'data.eval_split': its examples are {list(evals.spec.input_shape)}, the training split's "
            f"{list(train.spec.input_shape)}; one model takes one shape: resize them alike"
        )
    spec = (train or evals).spec  # type: ignore[union-attr]
    if which == "eval":
        spec = data.spec_from_config(cfg) or spec  # the saved input shape: the model as it was trained
    return train, evals, spec


def _notice_unread(cfg: Config, which: str) -> None:
    """Say once what the config sets that its data does not read, and that a training run is evaluated on the
    split it trains on: each went by without a word, as though it applied."""
    from nnx_cli.data.sources import notice

    d = cfg.data
    if d.text_key is not None and d.format != "text":
        column = "data.messages_key" if d.format == "chat" else "data.prompt_key"
        notice(("text_key",), f"notice: data.text_key is not read with data.format={d.format} (rows: {column})")
    if d.train_on_prompt and d.format not in ("chat", "completion"):
        said = "notice: data.train_on_prompt is not read: it applies to data.format chat and completion"
        notice(("train_on_prompt",), said)
    if which == "train" and d.eval_split is not None and d.eval_split == d.train_split:
        said = f"notice: data.eval_split is the training split {d.train_split!r}: the evals score examples the run "
        notice(("eval_split",), said + "trains on, not held-out ones")


def _fill_model_shapes(
    cfg: Config, model_cls: type, spec: DataSpec, train: TrainSplit | None, evals: EvalSplit | None
) -> None:
    """Check the data fits the model, then record its input shape and class count in the config."""
    if train is not None:
        models.check_data(cfg.model, model_cls, spec, "label" in train.stored(), cfg.data.label_key)
    cfg.model.input_shape = cfg.model.input_shape or list(spec.input_shape)
    if cfg.model.num_classes is None:
        cfg.model.num_classes = spec.num_classes
    if getattr(model_cls, "needs_labels", False) and cfg.model.num_classes:
        if train is not None:
            _check_labels(train.stored()["label"], cfg.model.num_classes, "the training split")
        eval_labels = getattr(getattr(evals, "arrays", None), "label", None)  # an image split's
        if eval_labels is not None:
            _check_labels(eval_labels, cfg.model.num_classes, f"the eval split {cfg.data.eval_split!r}")
    vocab = cfg.model.options.get("vocab_size") or cfg.model.num_classes
    if spec.tokenizer is not None and spec.num_classes and vocab and vocab < spec.num_classes:
        key = "model.vocab_size" if cfg.model.options.get("vocab_size") else "model.num_classes"
        raise UserError(
            f"config key {key!r} is {vocab}, fewer rows than the tokenizer's {spec.num_classes:,} ids: a token "
            f"beyond them has no embedding; drop {key} (the tokenizer's is the default) or set it to at least "
            f"{spec.num_classes}"
        )
    if cfg.sharding.rules is None:
        rules = [list(r) for r in getattr(model_cls, "default_rules", sharding.DEFAULT_RULES)]
        cfg.sharding.rules = sharding.default_rules(rules, cfg.sharding.mesh)


def _check_labels(labels: Any, num_classes: int, split: str) -> None:
    """Class labels in [0, num_classes): one outside made the loss NaN at step 1 (in an eval split: the eval loss,
    which a run then kept as its best), or trained on nothing."""
    labels = np.asarray(labels)
    low, high = (int(labels.min()), int(labels.max())) if labels.size else (0, 0)
    if low < 0:
        raise UserError(
            f"config key 'data.label_key': {split} has the label {low}; labels are class indices, 0 to "
            "num_classes - 1: renumber them from 0"
        )
    if high >= num_classes:
        raise UserError(
            f"config key 'model.num_classes' is {num_classes}, but {split}'s labels run from {low} to "
            f"{high}; labels are class indices 0 to {num_classes - 1}: fix the labels, or set "
            f"model.num_classes={high + 1}"
        )


def _total_steps(cfg: Config, train: TrainSplit | None, steps_per_batch: int = 1) -> int | None:
    """`train.steps`, else `train.epochs` passes over the training split (an objective may take several
    optimizer steps on each batch: GRPO's `num_iterations`)."""
    if train is None:
        return None
    if cfg.train.steps:
        return cfg.train.steps
    return cfg.train.epochs * train.steps_per_epoch(cfg.train.batch_size) * steps_per_batch  # type: ignore[operator]


def _setup_optimizer(cfg: Config, total_steps: int | None) -> tuple[optax.GradientTransformation, optim.Schedule]:
    tx, schedule = optim.build(cfg.optimizer, total_steps)
    cfg.optimizer.name = optim.resolved_name(cfg.optimizer)
    return tx, schedule


def _keeps_reference(cfg: Config, objective: objectives.Objective, abstract: steps.TrainState) -> bool:
    """Whether the train state keeps a copy of its starting parameters as the objective's reference: it needs
    one, and the reference is not the model with its adapters off (adapters that start from zero).

    Fully fine-tuned, the copy is the reference (rather than reference log-probabilities computed once and
    cached with the data): objectives that score text sampled during training (GRPO's KL term) need the
    reference model itself, and so do evals of other data; it costs one more copy of the parameters, no
    optimizer state. Under LoRA it costs nothing.
    """
    if not objective.needs_reference:
        return False
    return steps.FROZEN not in abstract or cfg.checkpoint.init_from is not None


def _check_step(
    cfg: Config, moduledef: nnx.ModuleDef, tx: Any, abstract: Any, split: Any, objective: objectives.Objective
) -> list[str]:
    """Trace one train step on shapes alone (a batch of the data's shapes); return the metric names."""
    size = cfg.train.batch_size // cfg.train.grad_accum_steps
    if hasattr(objective, "abstract_batch"):  # the objective makes its batches: GRPO's completions of prompts
        batch = objective.abstract_batch(size, split.width)
        return steps.check_step(moduledef, tx, cfg.model.name, abstract, batch, objective)
    if isinstance(split, TrainSplit):
        rows = split.read(split.epoch_keys(0)[:1])
    else:
        first = next(split.eval_batches(1), None)
        if first is None:
            raise UserError(
                f"config key 'data.eval_split': split {cfg.data.eval_split!r} of {cfg.data.source!r} has no rows"
            )
        rows = {k: v for k, v in first.items() if k != "mask"}
    stored = {k: jax.ShapeDtypeStruct((size, *np.shape(v)[1:]), np.asarray(v).dtype) for k, v in rows.items()}
    batch = jax.eval_shape(split.prepare, stored)
    return steps.check_step(moduledef, tx, cfg.model.name, abstract, batch, objective)


def _check_images(cfg: Config, moduledef: nnx.ModuleDef, abstract: Any, evals: EvalSplit) -> None:
    """Trace the model's `images` on an eval batch's shapes: images that cannot be made, or not as `[N, H, W, C]`
    (or `[N, H, W]`), are a UserError here; at the first eval they ended the run with a traceback, before the
    checkpoint of its last steps."""
    size = cfg.train.eval_batch_size or cfg.train.batch_size
    first = next(evals.eval_batches(1), None)
    if first is None:
        return  # an empty eval split is refused where the step is checked
    batch = {k: jax.ShapeDtypeStruct((size, *np.shape(v)[1:]), np.asarray(v).dtype) for k, v in first.items()}
    where = f"model {cfg.model.name!r}: its images()"
    try:
        images = jax.eval_shape(functools.partial(steps.images_step, moduledef, cfg.seed, evals.prepare), abstract,
                                {k: v for k, v in batch.items() if k != "mask"})  # fmt: skip
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"{where} cannot run on an eval batch: {type(e).__name__}: {first_line(e)}") from None
    shape = getattr(images, "shape", None)
    if shape is None or len(shape) not in (3, 4):
        got = f"shape {list(shape)}" if shape is not None else type(images).__name__
        raise UserError(f"{where} must give one array of images, [N, H, W, C] or [N, H, W] in [0, 1]; got {got}")


def _check_keep_best(cfg: Config, metric_names: list[str], spec: DataSpec, evals: EvalSplit | None) -> None:
    best = cfg.checkpoint.keep_best
    if best is None:
        return
    if evals is None:
        raise UserError(
            "config key 'checkpoint.keep_best' needs evals, but data.eval_split is null; name an eval split, or "
            "set checkpoint.keep_best=null"
        )
    known = [*metric_names, *(["perplexity"] if reports_perplexity(cfg, spec) else [])]
    if best["metric"] not in known:
        raise UserError(
            f"config key 'checkpoint.keep_best.metric': {best['metric']!r} is not an eval metric of model "
            f"{cfg.model.name!r}{did_you_mean(best['metric'], known)}; its metrics: {', '.join(known)}"
        )


def reports_perplexity(cfg: Config, spec: DataSpec) -> bool:
    """Whether evals add `perplexity` (exp of the loss): a language model's own loss, not an objective's."""
    return spec.tokenizer is not None and cfg.objective.name == "sft"


def count_params(abstract: Any) -> int:
    """Parameters in the abstract train state."""
    return sum(math.prod(x.shape) for x in jax.tree.leaves(abstract["params"]))
