"""Hugging Face interop: model directories in (families, weights, tokenizer, chat templates).

A model directory (or Hub id) is a first-class input: `model.pretrained:
DIR` in a config, or DIR itself as the TARGET of `nnx-inspect`,
`nnx-generate` and `nnx-eval`. Its `config.json` gives the `transformer_lm`
options (:mod:`nnx_cli.hf.families`), its safetensors the parameters,
streamed into their shardings (:mod:`nnx_cli.hf.weights`), its tokenizer
files the tokenizer, stop tokens and chat template
(:mod:`nnx_cli.hf.tokenizer`; its chat template renders with :mod:`nnx_cli.data.chat`)::

    pretrained = open_pretrained("Qwen/Qwen2.5-0.5B-Instruct")   # config.json read, every tensor header checked
    pretrained.options                                          # {"num_layers": 24, ...}
    params = pretrained.load(abstract_params)                   # a State of Param in their shardings
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from nnx_cli.data import tokenizers
from nnx_cli.data.sources import notice
from nnx_cli.errors import UserError
from nnx_cli.hf import bnb, families
from nnx_cli.hf.hub import check_no_step, is_model_dir, resolve, resolve_target
from nnx_cli.hf.weights import Weights

__all__ = [
    "Pretrained",
    "apply_pretrained",
    "check_no_step",
    "is_model_dir",
    "model_dir_config",
    "open_pretrained",
    "resolve",
    "resolve_target",
]

_UNSET = object()
# Options a config may set for a pretrained model: they change how it runs, not what it computes.
_FREE = (
    "dtype",
    "scan_layers",
    "remat",
    "dropout",
    "attention_dropout",
    "bits_per_byte",
    "lora",
    "router_aux_loss_coef",
    "quantize",
)
# Of these, config.json may give a default that the YAML overrides (a mixture of experts' router_aux_loss_coef, a
# bitsandbytes checkpoint's quantize).
_RUNNING = ("attention", "max_positions")
# How the model runs (its attention kernel, its longest context): free where config.json does not give them (the
# length of a learned position table it does give, and that must agree).


@dataclasses.dataclass
class Pretrained:
    """A checked model directory: its family, options and weights (headers read, no tensor yet)."""

    source: str  # as the config says: a directory or a Hub id
    directory: Path
    family: families.Family
    options: dict[str, Any]
    weights: Weights
    maps: list[families.TensorMap]
    _checksums: Any = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def load(self, abstract: Any, say: Any = None, quantize: dict[str, Any] | None = None) -> Any:
        """The parameters `abstract` describes (a State of Param over ShapeDtypeStructs with shardings), read
        slice by slice from the safetensors files straight into their shardings; 4-bit kernels quantised as
        `quantize` (`model.quantize`) says, one layer's weight at a time."""
        from nnx_cli.hf import weights
        from nnx_cli.report import progress

        total = sum(math.prod(v.value.shape) for v in abstract.values())
        with progress(total, f"loading {self.directory.name}") as advance:
            return weights.load(self.weights, self.maps, abstract, advance, quantize)

    def lazy(self, abstract: Any) -> Any:
        """The parameters `abstract` describes (as for :meth:`load`; no 4-bit kernels), each a reader of its
        tensors that reads a layer when indexed (:class:`.weights.Lazy`) rather than an array: for an export,
        which writes each once."""
        import nnx
        from nnx_cli.hf import weights

        readers = weights.lazy(self.weights, self.maps, {path: v.value for path, v in abstract.items()})
        return nnx.State({path: v.replace(value=readers[path]) for path, v in abstract.items()})

    @functools.cached_property
    def stored_float(self) -> Any:
        """numpy's 16-bit float dtype when every tensor of the model is stored in it (a float32 parameter read in
        it loses nothing), else None."""
        import ml_dtypes
        import numpy as np

        names = [name for m in self.maps for name in m.names(self.options["num_layers"])]
        stored = {self.weights.info(name)[0] for name in names}
        return {"BF16": ml_dtypes.bfloat16, "F16": np.float16}.get(stored.pop()) if len(stored) == 1 else None

    @property
    def file_checksums(self) -> dict[str, str]:
        """xxh3-128 of each weight file: what an adapter checkpoint records, and what resuming one checks."""
        return self.hash_files().result()

    def hash_files(self) -> Any:
        """The future of :attr:`file_checksums`, computed once, on a thread of its own (reading and hashing let
        go of the GIL): a command that will check them calls this first, and what it does meanwhile (imports,
        restoring a checkpoint) hides the 0.2 s a 1 GB model's files take."""
        if self._checksums is None:
            import concurrent.futures

            from nnx_cli.hf.weights import file_checksums

            pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="nnx-checksums")
            self._checksums = pool.submit(file_checksums, self.weights.paths())
            pool.shutdown(wait=False)
        return self._checksums

    @property
    def checksum(self) -> str:
        """One checksum of the weight files: what `run.json` records."""
        from nnx_cli.hf.weights import checksum

        return checksum(self.file_checksums)

    def record(self) -> dict[str, Any]:
        """What an adapter checkpoint keeps of its base model: where it is and its files' checksums."""
        return {"pretrained": str(self.directory), "source": self.source, "files": self.file_checksums}

    def check_record(self, record: dict[str, Any], where: Path) -> None:
        """A UserError naming the file when the base weights differ from those `record` (of the checkpoint
        `where`) was trained on, and the base named then when model.pretrained names another one now."""
        for name, value in sorted(record.get("files", {}).items()):
            now = self.file_checksums.get(name)
            if now == value:
                continue
            what, fix = self.directory / name, "files, or point model.pretrained at the directory they came from"
            if now is None:
                problem = f"{what}: the base model's weights file is missing"
            else:
                problem = f"{what}: the base model's weights changed (checksum {value} when trained, {now} now)"
            if self.source.endswith(".gguf"):  # the directory is its conversion, named after its bytes
                what, fix = self.source, "file"
                problem = f"{what}: the base model's weights changed"
            trained_on = record.get("source") or record.get("pretrained")
            same = record.get("pretrained") == str(self.directory)  # the same directory, named relatively then
            if not same and trained_on not in (None, self.source, str(self.directory)):  # another base named now
                if now is None:  # a file of the base trained on, not of this one: no file of this base to name
                    problem = f"{self.source}: the base model's weight files are not those trained on"
                raise UserError(
                    f"{problem}: the adapters in {where} were trained on {trained_on!r}, and model.pretrained now "
                    f"names {self.source!r}; set it back to {trained_on!r}, or train on this base in a new --workdir"
                )
            raise UserError(f"{problem} since the adapters in {where} were trained on them; restore the original {fix}")


def read_config(directory: Path) -> dict[str, Any]:
    """A model directory's `config.json`; missing or unparsable is a UserError naming it."""
    path = directory / "config.json"
    if not path.is_file():
        raise UserError(f"{path}: no config.json; a Hugging Face model directory needs one (save_pretrained writes it)")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


@functools.lru_cache(maxsize=8)
def open_pretrained(source: str) -> Pretrained:
    """Resolve `source` (a directory or Hub id), read its `config.json` and check every tensor's header against
    it; raises UserError naming the file, key or tensor at fault."""
    directory = resolve(source)
    config = read_config(directory)
    family = families.family_of(config, str(directory / "config.json"))
    options = family.options(families.Config(config, str(directory / "config.json")))
    quantize = bnb.quantize_option(config, str(directory / "config.json"))
    if quantize is not None:  # a bitsandbytes checkpoint: a quantised base unless the YAML says otherwise
        options["quantize"] = quantize
    weights = Weights.open(directory)
    if quantize is not None and weights.bnb is not None:
        options["quantize"], kept = bnb.as_stored(quantize, weights.bnb, weights.files, str(directory / "config.json"))
        if kept:
            notice(
                ("unquantised projections", str(directory)),
                f"note: {directory} stores {', '.join(kept)} unquantised in some layers (llm_int8_skip_modules): "
                "they are read unquantised in every layer, the 4-bit ones dequantised exactly",
            )
    if options.get("tie_embeddings") and _head_of_its_own(weights, family, options):
        options["tie_embeddings"] = False
        notice(
            ("untied head", str(directory)),
            f"note: {directory / 'config.json'} ties the output head to the embedding (tie_word_embeddings), but "
            "the weights hold an lm_head.weight of other values; it is read untied, as transformers reads it",
        )
    maps = weights.check(family, options)
    return Pretrained(source, directory, family, options, weights, maps)


def _stored_quantize(stored: dict[str, Any], given: dict[str, Any], directory: Path) -> dict[str, Any]:
    """A 4-bit checkpoint's `model.quantize` (`stored`) with the YAML's settings (`given`) over it: one setting
    changes, the others stay (`{type: nf4}` reset the checkpoint's double quantisation to the default), and the
    projections it stores unquantised stay so. A UserError for another 4-bit type, block size or double
    quantisation: every weight was dequantised and quantised again on load, without a word."""
    from nnx_cli.models.transformer.options import quantize_options

    merged = {**stored, **given}
    if isinstance(given.get("skip"), list):
        merged["skip"] = [*stored.get("skip", []), *(s for s in given["skip"] if s not in stored.get("skip", []))]
    try:
        quantize_options(merged)
    except ValueError:
        return merged  # a mistake in a setting: the model's options check names it
    if merged.get("type") in ("nf4", "fp4"):
        for key in ("type", "block", "double_quant"):
            if merged.get(key) != stored.get(key):
                raise UserError(
                    f"config key 'model.quantize.{key}' is {merged.get(key)!r}, but {directory}'s 4-bit weights are "
                    f"stored with {key} {stored.get(key)!r}, and are read as stored, not quantised again: drop "
                    "model.quantize." + key + " (the YAML may change compute_dtype and skip, or read them dequantised "
                    "with type bfloat16 or quantize: null)"
                )
    return merged


def _head_of_its_own(weights: Weights, family: families.Family, options: dict[str, Any]) -> bool:
    """Whether the files hold an `lm_head.weight` that differs from the embedding (compared a block of rows at a
    time), for a family that can read an untied head: transformers 5 then keeps the two apart, whatever
    `tie_word_embeddings` says."""
    if "lm_head.weight" not in weights.files:
        return False
    untied = family.tensors({**options, "tie_embeddings": False}, weights.files)
    if not any(m.name == "lm_head.weight" for m in untied):
        return False
    embedding = next(m.name for m in untied if m.path == "embedding/embedding")
    head, table = weights.view("lm_head.weight"), weights.view(embedding)
    if head.shape != table.shape:
        return True
    rows = max(1, (64 << 20) // max(1, head[0].nbytes))
    return any(not np.array_equal(head[i : i + rows], table[i : i + rows]) for i in range(0, len(head), rows))


def apply_pretrained(cfg: Any) -> Pretrained | None:
    """`model.pretrained`: fill the model options from `config.json` (a YAML value that disagrees is a UserError
    naming both), check the weights' headers and the tokenizer; None when the config has no `model.pretrained`."""
    source = cfg.model.pretrained
    if source is None:
        return None
    if cfg.model.name != "transformer_lm":
        raise UserError(
            f"config key 'model.pretrained' loads Hugging Face language models into transformer_lm; model.name is "
            f"{cfg.model.name!r} (set model.name=transformer_lm)"
        )
    from nnx_cli.data import text

    if not text.is_text(cfg.data):
        raise UserError(
            "config key 'model.pretrained' is a language model, but the data is not text: set data.text_key (the "
            "column of documents, e.g. data.text_key=text)"
        )
    pretrained = open_pretrained(source)
    if Path(source).expanduser().is_dir():  # a local directory is recorded as an absolute path: found from anywhere
        cfg.model.pretrained = str(pretrained.directory)
    config_json = pretrained.directory / "config.json"
    _check_unread(cfg, pretrained.options, config_json)
    for key, value in pretrained.options.items():
        if key in _FREE:
            given = cfg.model.options.get(key)
            if key == "quantize" and isinstance(given, dict) and isinstance(value, dict):
                cfg.model.options[key] = _stored_quantize(value, given, pretrained.directory)
            else:
                cfg.model.options.setdefault(key, value)
            continue
        given = cfg.model.options.get(key, _UNSET)
        if given is not _UNSET and not _same(given, value):
            raise UserError(
                f"config key 'model.{key}' is {given!r}, but {config_json} says {value!r}: a pretrained model's shape "
                f"comes from its config.json; drop model.{key} (the YAML may set {', '.join(_FREE)})"
            )
        cfg.model.options[key] = value
    cfg.model.options.setdefault("dropout", 0.0)
    if cfg.data.tokenizer == "bytes":
        raise UserError(
            "config key 'data.tokenizer' is bytes, but model.pretrained was trained on its own tokenizer's ids (a "
            "byte's id is another token to it, and its exports would carry that tokenizer); drop data.tokenizer "
            "(pretrained is the default with model.pretrained)"
        )
    if cfg.data.tokenizer == "pretrained":
        from nnx_cli.hf.tokenizer import check_vocabulary

        check_vocabulary(pretrained_tokenizer(source), pretrained.options["vocab_size"], pretrained.directory)
    return pretrained


def _check_unread(cfg: Any, read: dict[str, Any], config_json: Path) -> None:
    """An option of the YAML's that config.json leaves at its default (a window on a Llama, experts on a dense
    model) would compute another function than the weights were trained for: a UserError, as a disagreement is."""
    from nnx_cli import models

    defaults = models.option_defaults(models.model_class(cfg.model.name))
    for key, given in cfg.model.options.items():
        if key in (*_FREE, *_RUNNING) or key in read or key not in defaults or _same(given, defaults[key]):
            continue
        raise UserError(
            f"config key 'model.{key}' is {given!r}, but {config_json} leaves it at {defaults[key]!r}: a pretrained "
            f"model's shape comes from its config.json; drop model.{key} (the YAML may set {', '.join(_FREE)})"
        )


def _same(given: Any, value: Any) -> bool:
    if isinstance(value, float) and isinstance(given, (int, float)) and not isinstance(given, bool):
        return float(given) == value
    if isinstance(value, dict) and isinstance(given, dict):
        return set(given) == set(value) and all(_same(given[k], value[k]) for k in value)
    return given == value


@functools.lru_cache(maxsize=8)
def pretrained_tokenizer(source: str) -> Any:
    """The tokenizer of model directory (or Hub id) `source`."""
    from nnx_cli.hf.tokenizer import PretrainedTokenizer

    tokenizers.import_tokenizers("pretrained")
    return PretrainedTokenizer(resolve(source))


tokenizers.provide_pretrained(pretrained_tokenizer)  # `data.tokenizer: pretrained` asks for it


def model_dir_config(target: str | Path, overrides: list[str], *, scan_layers: bool = True, **sections: Any) -> Any:
    """The config that makes a model directory (or Hub id) a TARGET: `transformer_lm` with `model.pretrained`
    set, its tokenizer, a text dataset (`data.source` from the overrides), windows of up to 1024 positions (fewer
    when the model has fewer), and stateless SGD (nothing trains: no optimizer state is allocated). `sections`
    are laid under the overrides (`train={"batch_size": 8}`)."""
    from nnx_cli.config import Config, apply_overrides, from_dict, merge, to_dict

    resolve_target(target)  # a Hub id that cannot be had is said of the TARGET, not of model.pretrained
    pretrained = open_pretrained(str(target))
    config = read_config(pretrained.directory)
    positions = pretrained.options.get("max_positions") or config.get("max_position_embeddings")
    seq_len = min(1024, positions) if isinstance(positions, int) and positions > 0 else 1024
    base = {
        "model": {"name": "transformer_lm", "pretrained": str(target), "scan_layers": scan_layers},
        "data": {"text_key": "text", "tokenizer": "pretrained", "seq_len": seq_len},
        "optimizer": {"name": "sgd"},
    }
    raw = apply_overrides(merge(merge(to_dict(Config()), base), sections), overrides)
    if raw["data"].get("format") not in (None, "text") and raw["data"].get("text_key") == "text":
        raw["data"]["text_key"] = None  # filled in above for text: chats and completions do not read it
    return from_dict(raw)
