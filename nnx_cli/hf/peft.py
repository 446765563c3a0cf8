"""PEFT LoRA adapters, in and out: `adapter_config.json` + `adapter_model.safetensors`.

PEFT stores an adapter on a Llama-family model as `lora_A.weight` `[rank, in]` and `lora_B.weight`
`[out, rank]` per adapted module (`base_model.model.model.layers.<i>.self_attn.q_proj...`), with rank,
alpha and the target modules in `adapter_config.json`. Ours are `nnx.LoRA`'s `a` `[in..., rank]` and
`b` `[rank, out...]`: the family's tensor tables (`families.lora_tensors`) map one onto the other, so an
adapter made by `peft` starts a run (`checkpoint.init_from: ADAPTER_DIR`), and a run's adapters export as
one that `peft` loads onto the base model (`nnx-export RUN --adapter`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nnx_cli.errors import UserError
from nnx_cli.hf import families

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_SHORT = {f"{short}_proj": short for short in ("q", "k", "v", "o", "gate", "up", "down")}


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / CONFIG).is_file()


def model_options(cfg: Any, pretrained: Any) -> dict[str, Any]:
    """The architecture options the tensor tables need, resolved (head_dim, num_kv_heads, mlp_dim, vocab)."""
    if pretrained is not None:
        return dict(pretrained.options)
    o = dict(cfg.model.options)
    heads, embed = o["num_heads"], o["embed_dim"]
    return {
        **o,
        "head_dim": o.get("head_dim") or embed // heads,
        "num_kv_heads": o.get("num_kv_heads") or heads,
        "mlp_dim": o.get("mlp_dim") or 4 * embed,
        "vocab_size": o.get("vocab_size") or cfg.model.num_classes,
    }


def _check_family(architecture: str, where: str) -> None:
    if architecture == families.GPT2:
        raise UserError(
            f"{where}: PEFT adapters on GPT2LMHeadModel adapt c_attn, which fuses q, k and v, while nnx adapts them "
            "apart; export merged weights (nnx-export RUN --merge) instead"
        )


def read(directory: Path, cfg: Any, pretrained: Any, lora: Any) -> tuple[Any, list[families.TensorMap]]:
    """The adapter's weights and tensor maps, checked against the run's `model.lora` (rank, alpha, targets):
    a UserError naming the key that differs."""
    from nnx_cli.hf.weights import Weights

    path = directory / CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not readable JSON ({e})") from None
    if config.get("peft_type") != "LORA":
        raise UserError(f"{path}: peft_type is {config.get('peft_type')!r}; nnx reads LORA adapters")
    for key in ("use_dora", "use_rslora", "fan_in_fan_out"):
        if config.get(key):
            raise UserError(f"{path}: {key} is true, which nnx's LoRA does not do")
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise UserError(f"{path}: the adapter also trains biases or whole modules, which nnx's LoRA does not do")
    architecture = families.architecture_of(model_options(cfg, pretrained))
    _check_family(architecture, str(path))
    modules = config.get("target_modules") or []
    modules = [modules] if isinstance(modules, str) else list(modules)
    unknown = [m for m in modules if m not in _SHORT]
    if unknown:
        raise UserError(f"{path}: target module {unknown[0]!r} is none of {', '.join(_SHORT)}")
    targets = sorted({_SHORT[m] for m in modules}, key=list(families.PEFT_MODULES).index)
    mine = {"r": lora.rank, "lora_alpha": lora.alpha, "target_modules": list(lora.targets)}
    theirs = {"r": config.get("r"), "lora_alpha": config.get("lora_alpha"), "target_modules": targets}
    for key in mine:
        if mine[key] != theirs[key] and not (key == "lora_alpha" and float(theirs[key] or 0) == mine[key]):
            ours = {"r": "rank", "lora_alpha": "alpha", "target_modules": "targets"}[key]
            raise UserError(
                f"{path}: {key} is {theirs[key]!r}, but model.lora.{ours} is {mine[key]!r}; set model.lora to "
                "match the adapter"
            )
    weights = Weights.open(directory, single=WEIGHTS, index_name=WEIGHTS + ".index.json")
    options = model_options(cfg, pretrained)
    maps = families.lora_tensors(options, lora.rank, lora.targets)
    family = families.Family(architecture, families.FAMILIES[architecture].options, lambda o, n: maps)
    weights.check(family, options, tie_ignores_head=False)
    return weights, maps


def config(cfg: Any, lora: Any, source: str | None) -> dict[str, Any]:
    """The `adapter_config.json` of a run's adapters."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": source,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": [families.PEFT_MODULES[t].split(".")[-1] for t in lora.targets],
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
    }


def tensor_maps(cfg: Any, pretrained: Any, lora: Any) -> list[families.TensorMap]:
    """The PEFT tensors of a run's adapters (a UserError for GPT-2, whose q, k and v PEFT fuses)."""
    options = model_options(cfg, pretrained)
    _check_family(families.architecture_of(options), "nnx-export --adapter")
    return families.lora_tensors(options, lora.rank, lora.targets)
