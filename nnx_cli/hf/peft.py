"""PEFT LoRA adapters, in and out: `adapter_config.json` + `adapter_model.safetensors`.

PEFT stores an adapter as `lora_A.weight` `[rank, in]` and `lora_B.weight` `[out, rank]` per adapted module,
named after the module it adapts (`base_model.model.model.layers.<i>.self_attn.q_proj.lora_A.weight`), with
rank, alpha and the target modules in `adapter_config.json`; its update is `x A^T B^T (lora_alpha / r)`.
Ours are `nnx.LoRA`'s `a` `[in..., rank]` and `b` `[rank, out...]` with the update `x a b (alpha / rank)`: the
same numbers, transposed. So an adapter `peft` made starts a run (`checkpoint.init_from: ADAPTER_DIR`,
:func:`load`), and a run's adapters export as one that `peft` loads onto the base model (`nnx-export RUN
--adapter`, :func:`adapter`)::

    config, shapes, tensors = adapter(exp, lora, params)    # adapter_config.json, and the tensors to write
    adapters = load(exp, Path("my-adapter"))                 # the run's LoRAParams, from PEFT's files

The Llama family (Llama, Mistral, Qwen2, Qwen3) adapts the seven projections by their module names
(`q_proj` ... `down_proj`). GPT-2 fuses q, k and v into one `c_attn`: a run's three adapters of rank `r`
export as one exact block adapter on `c_attn` of rank `n r` (`n` of q, k, v adapted: `lora_A` stacks their
`a`, `lora_B` holds each `b` in its own block of rows and columns, zeros elsewhere) whose alpha is `n alpha`,
so that `alpha / rank` is kept (`rank_pattern` and `alpha_pattern` say so for `c_attn`). Reading works for
the Llama family only: an adapter `peft` trained on `c_attn` is in general no sum of separate q, k, v adapters.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from nnx_cli.errors import UserError
from nnx_cli.hf import families

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
_SHORT = {f"{short}_proj": short for short in ("q", "k", "v", "o", "gate", "up", "down")}
_OURS = {"q": "attention/query", "k": "attention/key", "v": "attention/value", "o": "attention/out",
         "gate": "mlp/gate", "up": "mlp/fc", "down": "mlp/proj"}  # fmt: skip
_GPT2 = {"o": "attn.c_proj", "up": "mlp.c_fc", "down": "mlp.c_proj"}  # and q, k, v: the fused attn.c_attn
_UNSUPPORTED = ("use_dora", "use_rslora", "fan_in_fan_out", "lora_bias", "layers_to_transform", "exclude_modules",
                "target_parameters", "trainable_token_indices", "layer_replication", "alora_invocation_tokens",
                "use_qalora", "use_bdlora")  # fmt: skip
"""`adapter_config.json` keys that, set, make an adapter nnx's LoRA cannot be (or cannot tell it is)."""


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


def _lora_of(exp: Any) -> Any:
    from nnx_cli.models.transformer import lora_options

    options = exp.cfg.model.options
    return lora_options(options.get("lora"), options.get("mlp", "gelu"), options.get("moe"))


# In: checkpoint.init_from an adapter directory
# ------------------------------------------------------------------------------


def load(exp: Any, directory: Path) -> Any:
    """A PEFT adapter's `lora_A`/`lora_B` as the run's adapters (a State of LoRAParam in their shardings); its
    rank, alpha and targets must be the run's `model.lora` (a UserError naming the key that differs)."""
    from nnx_cli.hf import weights

    lora = _lora_of(exp)
    if lora is None:
        raise UserError(
            f"config key 'checkpoint.init_from': {str(directory)!r} is a PEFT adapter, but the run has no "
            "model.lora to load it into; set model.lora to its rank, alpha and targets"
        )
    adapter, maps = read(directory, exp.cfg, exp.pretrained, lora)
    return weights.load(adapter, maps, exp.restore_target()["params"])


def read(directory: Path, cfg: Any, pretrained: Any, lora: Any) -> tuple[Any, list[families.TensorMap]]:
    """The adapter's weights (headers checked) and tensor maps, checked against the run's `model.lora` (rank,
    alpha, targets): a UserError naming the key that differs."""
    from nnx_cli.hf.weights import Weights

    path = directory / CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        peft_type = config.get("peft_type") if isinstance(config, dict) else None
        raise UserError(f"{path}: peft_type is {peft_type!r}; nnx reads LORA adapters")
    for key in _UNSUPPORTED:
        if config.get(key):
            raise UserError(f"{path}: {key} is {config[key]!r}, which nnx's LoRA does not do")
    if config.get("bias", "none") != "none" or config.get("modules_to_save"):
        raise UserError(f"{path}: the adapter also trains biases or whole modules, which nnx's LoRA does not do")
    for key, base in (("rank_pattern", "r"), ("alpha_pattern", "lora_alpha")):
        differ = {k: v for k, v in (config.get(key) or {}).items() if v != config.get(base)}
        if differ:
            raise UserError(f"{path}: {key} gives some modules another {base} ({differ}); nnx's LoRA has one rank and "
                            "one alpha for all")  # fmt: skip
    options = model_options(cfg, pretrained)
    architecture = families.run_architecture(options, pretrained)
    if architecture in (families.GPT2, families.PHI3):
        fused = "c_attn" if architecture == families.GPT2 else "qkv_proj (and gate and up on gate_up_proj)"
        raise UserError(
            f"{path}: nnx reads PEFT adapters of the Llama family (Llama, Mistral, Qwen2, Qwen3) and Gemma; a "
            f"{architecture} adapter on {fused} fuses q, k and v in one rank, which nnx's separate q, k and v "
            "adapters cannot hold"
        )
    modules = config.get("target_modules") or []
    modules = [modules] if isinstance(modules, str) else list(modules)
    unknown = [m for m in modules if m not in _SHORT]
    if unknown:
        raise UserError(f"{path}: target module {unknown[0]!r} is none of {', '.join(_SHORT)}")
    targets = sorted({_SHORT[m] for m in modules}, key=list(families.PEFT_MODULES).index)
    mine = {"r": lora.rank, "lora_alpha": lora.alpha, "target_modules": list(lora.targets)}
    theirs = {"r": config.get("r"), "lora_alpha": config.get("lora_alpha"), "target_modules": targets}
    for key in mine:
        same = mine[key] == theirs[key] or (key == "lora_alpha" and float(theirs[key] or 0) == mine[key])
        if not same:
            ours = {"r": "rank", "lora_alpha": "alpha", "target_modules": "targets"}[key]
            raise UserError(
                f"{path}: {key} is {theirs[key]!r}, but model.lora.{ours} is {mine[key]!r}; set model.lora to "
                "match the adapter"
            )
    weights = Weights.open(directory, single=WEIGHTS, index_name=WEIGHTS + ".index.json")
    maps = families.lora_tensors(options, lora.rank, lora.targets)
    family = families.Family(architecture, families.FAMILIES[architecture].options, lambda o, n: maps)
    weights.check(family, options, tie_ignores_head=False)
    return weights, maps


# Out: nnx-export --adapter
# ------------------------------------------------------------------------------


def check_exportable(cfg: Any, pretrained: Any, lora: Any) -> None:
    """`--adapter` needs adapters, and the published base model they adapt."""
    if lora is None:
        raise UserError("--adapter exports a run's LoRA adapters, and this run has none (no model.lora); drop it")
    if pretrained is None:
        raise UserError(
            "--adapter writes an adapter for the base model.pretrained names, and this run has none (its frozen "
            "weights are its own initialisation); drop --adapter to export the merged weights"
        )
    experts = [t for t in lora.targets if t.startswith("expert_")]
    if experts:
        raise UserError(
            f"--adapter: model.lora.targets adapts each expert's projections ({', '.join(experts)}), which PEFT "
            "files of transformers' fused experts do not hold; drop --adapter to export the merged weights"
        )
    dense = [t for t in lora.targets if t in ("gate", "up", "down")]
    if dense and (pretrained.options.get("moe") or {}).get("dense_layers"):
        # peft loads their tensors onto the sparse layers' fused experts (mlp.gate_proj is those experts' name in
        # transformers 5) and leaves the dense layers' MLP as it was: logits as if they had not trained
        raise UserError(
            f"--adapter: model.lora.targets adapts the MLP projections ({', '.join(dense)}) of the dense layers of "
            "a mixture of experts, which PEFT places on the other layers' fused experts instead; drop --adapter to "
            "export the merged weights, or leave gate, up and down out of model.lora.targets"
        )


def adapter(exp: Any, lora: Any, params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, tuple], Iterator]:
    """The run's adapters as PEFT writes them: `adapter_config.json`'s contents, `{tensor: shape}` in name order,
    and the (name, array) pairs in that order, each made as it is asked for."""
    from nnx_cli.hf.weights import tensors_of

    cfg, pretrained = exp.cfg, exp.pretrained
    options = model_options(cfg, pretrained)
    adapters = {p: v for p, v in params.items() if "/lora/" in p}
    architecture = families.run_architecture(options, pretrained)
    if architecture == families.GPT2:
        return _gpt2_adapter(cfg, pretrained, options, lora, adapters)
    if architecture == families.PHI3:
        return _phi3_adapter(pretrained, options, lora, adapters)
    maps = families.lora_tensors(options, lora.rank, lora.targets)
    modules = [families.PEFT_MODULES[t].split(".")[-1] for t in lora.targets]
    config = _config(pretrained, lora, modules)
    return config, families.layout(maps, options["num_layers"]), tensors_of(adapters, maps)


def _config(pretrained: Any, lora: Any, modules: list[str], **extra: Any) -> dict[str, Any]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": pretrained.source,
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        **extra,
    }


def _gpt2_adapter(cfg: Any, pretrained: Any, options: dict, lora: Any, adapters: dict) -> tuple[dict, dict, Iterator]:
    """GPT-2's `Conv1D` modules (`fan_in_fan_out`), with q, k and v as one block adapter on `c_attn`."""
    embed, mlp, rank = options["embed_dim"], options["mlp_dim"], lora.rank
    fused = [t for t in ("q", "k", "v") if t in lora.targets]
    others = [t for t in lora.targets if t in _GPT2]
    sizes = {"o": (embed, embed), "up": (embed, mlp), "down": (mlp, embed)}  # (in, out)

    def ours(target: str, part: str, i: int) -> np.ndarray:
        """Our `a` as `[in, rank]` or `b` as `[rank, out]`, of layer `i`."""
        path = f"{_OURS[target]}/lora/{part}"
        stacked = adapters.get("layers/scan_module/" + path)
        value = np.asarray(stacked[i] if stacked is not None else adapters[f"layers/{i}/{path}"], np.float32)
        return value.reshape(-1, rank) if part == "a" else value.reshape(rank, -1)

    def block_b(i: int) -> np.ndarray:
        out = np.zeros((3 * embed, len(fused) * rank), np.float32)
        for j, t in enumerate(fused):
            column = "qkv".index(t)
            out[column * embed : (column + 1) * embed, j * rank : (j + 1) * rank] = ours(t, "b", i).T
        return out

    makers: dict[str, tuple[tuple[int, ...], Callable[[], np.ndarray]]] = {}
    for i in range(options["num_layers"]):
        layer = f"base_model.model.transformer.h.{i}."
        if fused:
            stack = lambda i=i: np.concatenate([ours(t, "a", i).T for t in fused])  # noqa: E731
            makers[layer + "attn.c_attn.lora_A.weight"] = ((len(fused) * rank, embed), stack)
            makers[layer + "attn.c_attn.lora_B.weight"] = ((3 * embed, len(fused) * rank), lambda i=i: block_b(i))
        for t in others:
            fan_in, fan_out = sizes[t]
            makers[f"{layer}{_GPT2[t]}.lora_A.weight"] = ((rank, fan_in), lambda t=t, i=i: ours(t, "a", i).T)
            makers[f"{layer}{_GPT2[t]}.lora_B.weight"] = ((fan_out, rank), lambda t=t, i=i: ours(t, "b", i).T)
    names = sorted(makers)
    modules = (["c_attn"] if fused else []) + [_GPT2[t] for t in others]
    patterns = {}
    if len(fused) > 1:  # c_attn's rank is n r: its alpha n alpha keeps the scale alpha / r
        patterns = {"rank_pattern": {"c_attn": len(fused) * rank}, "alpha_pattern": {"c_attn": len(fused) * lora.alpha}}
    config = _config(pretrained, lora, modules, fan_in_fan_out=True, **patterns)
    return config, {n: makers[n][0] for n in names}, ((n, makers[n][1]()) for n in names)


_PHI3_FUSED = {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up")}
_PHI3_PLAIN = {"o": "self_attn.o_proj", "down": "mlp.down_proj"}


def _phi3_adapter(pretrained: Any, options: dict, lora: Any, adapters: dict) -> tuple[dict, dict, Iterator]:
    """Phi-3's fused `qkv_proj` and `gate_up_proj`: the run's adapters of rank `r` on the `n` of q, k, v (or gate
    and up) adapted export as one exact block adapter of rank `n r` on the fused module, as GPT-2's on `c_attn`
    (`lora_A` stacks their `a`, `lora_B` holds each `b` in its rows of the fused output; alpha `n alpha`)."""
    embed, mlp, rank = options["embed_dim"], options["mlp_dim"], lora.rank
    q, kv = options["num_heads"] * options["head_dim"], options["num_kv_heads"] * options["head_dim"]
    widths = {"q": q, "k": kv, "v": kv, "gate": mlp, "up": mlp}
    sizes = {"o": (q, embed), "down": (mlp, embed)}  # (in, out)

    def ours(target: str, part: str, i: int) -> np.ndarray:
        """Our `a` as `[in, rank]` or `b` as `[rank, out]`, of layer `i`."""
        path = f"{_OURS[target]}/lora/{part}"
        stacked = adapters.get("layers/scan_module/" + path)
        value = np.asarray(stacked[i] if stacked is not None else adapters[f"layers/{i}/{path}"], np.float32)
        return value.reshape(-1, rank) if part == "a" else value.reshape(rank, -1)

    def block_b(i: int, parts: tuple[str, ...], fused: list[str]) -> np.ndarray:
        out = np.zeros((sum(widths[t] for t in parts), len(fused) * rank), np.float32)
        start = 0
        for t in parts:
            if t in fused:
                j = fused.index(t)
                out[start : start + widths[t], j * rank : (j + 1) * rank] = ours(t, "b", i).T
            start += widths[t]
        return out

    makers: dict[str, tuple[tuple[int, ...], Callable[[], np.ndarray]]] = {}
    modules, patterns = [], {"rank_pattern": {}, "alpha_pattern": {}}
    for module, parts in _PHI3_FUSED.items():
        fused = [t for t in parts if t in lora.targets]
        if not fused:
            continue
        short = module.split(".")[-1]
        modules.append(short)
        if len(fused) > 1:  # the fused module's rank is n r: its alpha n alpha keeps the scale alpha / r
            patterns["rank_pattern"][short] = len(fused) * rank
            patterns["alpha_pattern"][short] = len(fused) * lora.alpha
        for i in range(options["num_layers"]):
            name = f"base_model.model.model.layers.{i}.{module}"
            stack = lambda i=i, fused=fused: np.concatenate([ours(t, "a", i).T for t in fused])  # noqa: E731
            makers[name + ".lora_A.weight"] = ((len(fused) * rank, embed), stack)
            b = lambda i=i, parts=parts, fused=fused: block_b(i, parts, fused)  # noqa: E731
            makers[name + ".lora_B.weight"] = ((sum(widths[t] for t in parts), len(fused) * rank), b)
    for t, module in _PHI3_PLAIN.items():
        if t not in lora.targets:
            continue
        modules.append(module.split(".")[-1])
        fan_in, fan_out = sizes[t]
        for i in range(options["num_layers"]):
            name = f"base_model.model.model.layers.{i}.{module}"
            makers[name + ".lora_A.weight"] = ((rank, fan_in), lambda t=t, i=i: ours(t, "a", i).T)
            makers[name + ".lora_B.weight"] = ((fan_out, rank), lambda t=t, i=i: ours(t, "b", i).T)
    names = sorted(makers)
    config = _config(pretrained, lora, modules, **patterns)
    return config, {n: makers[n][0] for n in names}, ((n, makers[n][1]()) for n in names)
