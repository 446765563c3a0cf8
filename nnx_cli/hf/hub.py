"""`model.pretrained`: a local model directory, or a Hugging Face Hub id downloaded once into the usual cache.

Only the files a run needs are fetched (`config.json`, the safetensors
weights, the tokenizer and generation files); later runs, offline ones
included, read them from the Hugging Face cache (`HF_HOME`, `HF_HUB_CACHE`)::

    directory = resolve("Qwen/Qwen2.5-0.5B-Instruct")   # .../models--Qwen--Qwen2.5-0.5B-Instruct/snapshots/<rev>
    directory = resolve("/models/my-llama")             # a local directory, as it is
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from nnx_cli.errors import UserError, did_you_mean

_KEY = "config key 'model.pretrained'"
CONFIG = "config.json"
_OPTIONAL = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def looks_local(source: str) -> bool:
    """Whether `source` is meant as a path rather than a Hub id (`org/name`)."""
    return source.startswith(("/", "./", "../", "~", ".\\")) or source.count("/") != 1 or Path(source).exists()


def check_no_step(target: str | Path, step: int | None, best: bool) -> None:
    """A UserError for `--step` or `--best` with a model directory, Hub id or GGUF file as TARGET (what
    :func:`is_model_dir` takes): they pick a checkpoint of a run."""
    if step is not None or best:
        path = Path(target).expanduser()
        kind = "a GGUF file" if path.is_file() else "a model directory" if path.is_dir() else "a Hub model id"
        raise UserError(f"--step and --best pick a checkpoint of a run; {str(target)!r} is {kind}")


def is_model_dir(target: str | Path) -> bool:
    """Whether `target` is a Hugging Face model directory (it has a `config.json` and no `checkpoints/`), a Hub
    id, or a GGUF file (which stands for one): what `nnx-inspect`, `nnx-generate` and `nnx-eval` take instead of a
    work dir. A path that does not exist beside work dirs (`runs/digits_vea` where `runs/digits_vae` holds
    checkpoints), or that names a YAML file, is a mistyped work dir or config, not a Hub id: the command says it
    does not exist rather than asking the Hub for it. Beside model directories (`meta-llama/` holding a
    download) it is still a Hub id."""
    path = Path(target).expanduser()
    if path.is_file():
        from nnx_cli.gguf.read import is_gguf

        return is_gguf(path)
    if path.is_dir():
        return (path / CONFIG).is_file() and not (path / "checkpoints").is_dir() and not (path / "state").is_dir()
    if path.exists() or looks_local(str(target)) or path.suffix in (".yaml", ".yml"):  # a config file's name
        return False
    return not _beside_work_dirs(path)


def _beside_work_dirs(path: Path) -> bool:
    """Whether `path`'s parent is a local directory holding a work dir (a directory with `checkpoints/`)."""
    if not path.parent.is_dir():
        return False
    return any((sibling / "checkpoints").is_dir() for sibling in path.parent.iterdir() if sibling.is_dir())


@functools.lru_cache(maxsize=16)
def resolve(source: str, key: str = _KEY) -> Path:
    """The local directory of `model.pretrained`: the directory itself, a Hub model's cached snapshot
    (downloaded the first time), or the directory a GGUF file stands for (made the first time). `key` names
    what gave `source` in the messages: a command's TARGET is :func:`resolve_target`'s."""
    path = Path(source).expanduser()
    if path.is_file():
        from nnx_cli.gguf.read import is_gguf, model_dir

        if is_gguf(path):
            return model_dir(path)
    if path.is_dir():
        if not (path / CONFIG).is_file():
            raise UserError(
                f"{key}: {str(path / CONFIG)!r} does not exist; point {_name(key)} at a Hugging Face model "
                "directory (one saved by save_pretrained, or downloaded with `hf download`)"
            )
        return path.absolute()
    if looks_local(source):
        raise UserError(f"{key}: model directory {source!r} does not exist")
    return _download(source, key)


def resolve_target(target: str | Path) -> Path:
    """:func:`resolve` for a command's TARGET, which the messages name (not `model.pretrained`, which the user
    never set)."""
    return resolve(str(target), "TARGET")


def _name(key: str) -> str:
    return "model.pretrained" if key == _KEY else key


def _download(repo_id: str, key: str) -> Path:
    """Fetch `config.json`, the weights named by the index (or `model.safetensors`) and the tokenizer files of a
    Hub model into the Hugging Face cache, reading what is cached already; returns the snapshot directory."""
    config = _fetch(repo_id, CONFIG, key, required=True)
    directory = config.parent
    index = _fetch(repo_id, "model.safetensors.index.json", key, required=False)
    if index is not None:
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            shards = []  # reported as an unreadable index when the weights are opened
        for shard in shards:
            _fetch(repo_id, shard, key, required=True)
    elif _fetch(repo_id, "model.safetensors", key, required=False) is None:
        raise UserError(
            f"{key}: Hub model {repo_id!r} has no model.safetensors or model.safetensors.index.json; nnx reads "
            "safetensors weights only"
        )
    for name in _OPTIONAL:
        _fetch(repo_id, name, key, required=False)
    return directory


def _fetch(repo_id: str, filename: str, key: str, *, required: bool) -> Path | None:
    """One file of a Hub model from the cache, else downloaded; None for an optional file the model lacks."""
    import huggingface_hub
    from huggingface_hub import errors
    from huggingface_hub.utils import logging

    logging.set_verbosity_error()  # failures are reported as one UserError below
    try:
        return Path(huggingface_hub.hf_hub_download(repo_id, filename, local_files_only=True))
    except (errors.LocalEntryNotFoundError, errors.EntryNotFoundError, OSError, ValueError):
        pass  # not cached yet (or cached as missing): ask the Hub
    from nnx_cli.data.sources import announce_download

    announce_download(f"Hub model {repo_id!r}")
    try:
        return Path(huggingface_hub.hf_hub_download(repo_id, filename))
    except errors.HFValidationError:
        raise UserError(
            f"{key}: {repo_id!r} is neither a local model directory nor a Hugging Face Hub id (org/name)"
        ) from None
    except errors.LocalEntryNotFoundError as e:  # offline, or the Hub cannot be reached (a kind of EntryNotFoundError)
        if not required:  # an optional file that is not cached: the model works without it
            return None
        what = "no directory" if key == _KEY else "no work dir, model dir or GGUF file"
        raise UserError(
            f"{key}: {repo_id!r} is {what} under {os.getcwd()}{_closest(repo_id)} (a relative path is read from "
            f"where the command runs), and as a Hub model it cannot be loaded: the Hugging Face Hub cannot be "
            f"reached (or HF_HUB_OFFLINE is set) and {filename} is not in the local cache ({type(e).__name__}). "
            f"Run once with network access so it is cached, or download it (hf download {repo_id} --local-dir "
            f"DIR) and {'set model.pretrained=DIR' if key == _KEY else 'give DIR'}"
        ) from None
    except errors.EntryNotFoundError:  # the Hub answered: the file is not there
        if required:
            raise UserError(f"{key}: Hub model {repo_id!r} has no {filename}") from None
        return None
    except (errors.RepositoryNotFoundError, errors.GatedRepoError):
        raise UserError(
            f"{key}: no Hub model {repo_id!r}{_closest(repo_id)} (or it is gated: log in with `hf auth login` "
            "after accepting its license on the Hub)"
        ) from None
    except (OSError, errors.HfHubHTTPError) as e:
        raise UserError(
            f"{key}: cannot download {filename} of Hub model {repo_id!r}: {type(e).__name__}: {e}"
        ) from None


def _closest(repo_id: str) -> str:
    """` (did you mean 'runs/digits_vae'?)` for a local directory close to `repo_id` (a mistyped work dir,
    `run/digits_vae`, is an org/name too), else ""."""
    import difflib

    org, _, name = repo_id.partition("/")
    folders = [p.name for p in Path(".").iterdir() if p.is_dir() and not p.name.startswith(".")]
    for near in difflib.get_close_matches(org, folders, n=3, cutoff=0.6):  # the folder, as did_you_mean matches
        if match := did_you_mean(name, [p.name for p in Path(near).iterdir() if p.is_dir()], prefix=f"{near}/"):
            return match
    return ""
