"""bitsandbytes 4-bit checkpoints: read as a quantised base, and written as `transformers` writes them.

A model directory that `transformers` saved with a `BitsAndBytesConfig(load_in_4bit=True)` (the Hub's
`*-bnb-4bit` models) says so in `config.json` (`quantization_config`), and stores each quantised `Linear`'s
weight `W` `[out, in]` as tensors beside its name::

    ...q_proj.weight                                 uint8 [out * in / 2, 1]: two 4-bit codes a byte
    ...q_proj.weight.absmax                          the block scales (uint8 when double-quantised, else float32)
    ...q_proj.weight.quant_map                       the 16 values of the type (nf4 or fp4)
    ...q_proj.weight.nested_absmax                   float32: the block scales' own scales (double quantisation)
    ...q_proj.weight.nested_quant_map                the dynamic 8-bit map they are stored in
    ...q_proj.weight.quant_state.bitsandbytes__nf4   JSON bytes: quant_type, blocksize, dtype, shape, nested_offset

:func:`quantize_option` turns `quantization_config` into the `model.quantize` option (the YAML may override
it), :class:`Tensors` finds the quantised weights among a directory's tensors and checks that each has its
quant state, and :func:`parts` reads one into `nnx.QuantizedKernel`'s layout, bit for bit. A weight that the
model holds unquantised (`model.quantize: null`, a skipped projection) is dequantised as it loads
(:func:`dequantized`); a float weight where the model wants 4 bits is quantised as it loads. :func:`tensors`
writes a quantised weight back in this layout (`nnx-export --format bnb-4bit`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np

from nnx.nn import quantize as q
from nnx_cli.errors import UserError

STATE = ".quant_state.bitsandbytes__"  # + nf4 | fp4
AUXILIARY = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map")
_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
_COMPUTE = {"float32": "float32", "bfloat16": "bfloat16", "torch.float32": "float32", "torch.bfloat16": "bfloat16"}


def quantize_option(config: Mapping[str, Any], path: str) -> dict[str, Any] | None:
    """The `model.quantize` a `config.json` implies: None without a `quantization_config`; for a bitsandbytes
    4-bit one `{type, block: 64, double_quant, compute_dtype, skip}` (:func:`as_stored` then fits it to the
    weights' quant states); a UserError naming the key for 8-bit weights or another quantisation method."""
    settings = config.get("quantization_config")
    if settings is None:
        return None
    where = f"{path}: key 'quantization_config'"
    if not isinstance(settings, Mapping):
        raise UserError(f"{where} must be a mapping, got {settings!r}")
    method = settings.get("quant_method", "bitsandbytes")
    if method != "bitsandbytes":
        raise UserError(f"{where} has quant_method {method!r}: nnx reads bitsandbytes 4-bit checkpoints only")
    if settings.get("load_in_8bit") or settings.get("_load_in_8bit"):
        raise UserError(
            f"{where} has load_in_8bit: its weights are bitsandbytes 8-bit, which nnx does not read; use the "
            "model's 16-bit checkpoint (with model.quantize to store it in 4 bits), or a 4-bit one"
        )
    if not (settings.get("load_in_4bit") or settings.get("_load_in_4bit")):
        raise UserError(f"{where} has neither load_in_4bit nor load_in_8bit: not a bitsandbytes checkpoint nnx knows")
    kind = settings.get("bnb_4bit_quant_type", "fp4")
    if kind not in q.TYPES:
        raise UserError(f"{where} has bnb_4bit_quant_type {kind!r}; nnx reads {', '.join(q.TYPES)}")
    compute = settings.get("bnb_4bit_compute_dtype")
    option = {"type": kind, "block": 64, "double_quant": bool(settings.get("bnb_4bit_use_double_quant", False))}
    if compute is not None:
        option["compute_dtype"] = _COMPUTE.get(str(compute), "bfloat16")
    skip = [name.rsplit(".", 1)[-1] for name in settings.get("llm_int8_skip_modules") or []]
    if skip:
        from nnx_cli.models.transformer.options import _TARGET_ALIASES

        option["skip"] = [name for name in skip if name in _TARGET_ALIASES]
    return option


_HF_PROJECTIONS = {  # the Hugging Face names of the projections model.quantize stores in 4 bits
    **{f"{short}_proj": f"{short}_proj" for short in ("q", "k", "v", "o", "gate", "up", "down")},
    **{name: name for name in ("qkv_proj", "gate_up_proj", "c_attn", "c_fc", "attn.c_proj", "mlp.c_proj")},
    **{name: name for name in ("w1", "w2", "w3")},  # Mixtral's experts
}
_HF_EXPERTS = {"gate_proj": "expert_gate", "up_proj": "expert_up", "down_proj": "expert_down"}  # inside `experts`


def as_stored(option: dict[str, Any], tensors: Tensors, names: Iterable[str], where: str) -> tuple[dict, list[str]]:
    """`option` (:func:`quantize_option`'s) made to read the weights as they are stored, and the projections it
    adds to `skip`. The type, block size and double quantisation come from the weights' own quant states (as
    `transformers` reads each weight; `quantization_config` does not name a block size). A projection that some
    layer stores unquantised is kept unquantised in every layer (the 4-bit ones dequantised exactly, as
    bitsandbytes multiplies them): `llm_int8_skip_modules` may name whole modules of single layers
    (`model.layers.0.self_attn`, as Unsloth's dynamic 4-bit models do), whose weights were quantised on load."""
    kinds = sorted({(state.type, state.block, state.double) for state in tensors.states.values()})
    if not kinds:
        return option, []
    if len(kinds) > 1:
        ways = "; ".join(f"{kind} in blocks of {block}{', double-quantised' * double}" for kind, block, double in kinds)
        raise UserError(f"{where}: its 4-bit weights are quantised in several ways ({ways}); nnx reads one")
    (kind, block, double) = kinds[0]
    option = {**option, "type": kind, "block": block, "double_quant": double}
    skip = list(option.get("skip", []))
    added: list[str] = []
    for name in names:
        if not name.endswith(".weight") or name in tensors.states:
            continue
        module = name.removesuffix(".weight").split(".")
        alias = _HF_PROJECTIONS.get(".".join(module[-2:])) or _HF_PROJECTIONS.get(module[-1])
        if alias is not None and "experts" in module:
            alias = _HF_EXPERTS.get(alias, alias)
        if alias is not None and alias not in skip:
            skip.append(alias)
            added.append(alias)
    if skip:
        option["skip"] = skip
    return option, added


class State:
    """One quantised weight's quant state: its type, block size, PyTorch shape and dtype, nested offset."""

    def __init__(self, name: str, data: Mapping[str, Any], where: str):
        try:
            self.type = str(data["quant_type"])
            self.block = int(data["blocksize"])
            self.shape = tuple(int(n) for n in data["shape"])
            self.dtype = _DTYPES[str(data.get("dtype", "float32")).removeprefix("torch.")]
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"{where}: the quant state of {name!r} is not bitsandbytes' ({e})") from None
        self.offset = data.get("nested_offset")
        self.double = self.offset is not None
        if self.double and (
            isinstance(self.offset, bool) or not isinstance(self.offset, (int, float)) or not math.isfinite(self.offset)
        ):  # a string ended in a traceback where it is added, NaN dequantised every weight to NaN with exit 0
            raise UserError(
                f"{where}: the quant state of {name!r} has nested_offset {self.offset!r}; bitsandbytes writes a "
                "finite number there"
            )
        if self.type not in q.TYPES or self.block not in q.BLOCK_SIZES or len(self.shape) != 2:
            raise UserError(
                f"{where}: {name!r} is a {self.type} weight of shape {list(self.shape)} in blocks of {self.block}; "
                "nnx reads 2-D nf4 and fp4 weights in bitsandbytes' block sizes"
            )


class Tensors:
    """The bitsandbytes 4-bit weights among a directory's tensors (`names`: tensor name -> file), their states
    read by `read(name) -> bytes` and checked: each quantised weight has its scales and its quant state."""

    def __init__(self, names: Mapping[str, Any], info: Any, read: Any):
        self.states: dict[str, State] = {}
        for name in names:
            if STATE in name:
                weight = name[: name.index(STATE)]
                try:
                    data = json.loads(bytes(read(name)).decode())
                except (ValueError, UnicodeDecodeError) as e:
                    raise UserError(f"{names[name]}: tensor {name!r} is not a readable quant state ({e})") from None
                self.states[weight] = State(weight, data, str(names[name]))
        for weight, state in self.states.items():
            needed = [weight, weight + ".absmax", *([weight + ".nested_absmax"] if state.double else [])]
            for tensor in needed:
                if tensor not in names:
                    raise UserError(
                        f"{names[weight + STATE + state.type]}: tensor {tensor!r} is missing: a bitsandbytes "
                        "4-bit weight needs its codes, absmax and (double-quantised) nested_absmax"
                    )
            size = math.prod(state.shape)
            blocks = -(-size // state.block)
            expected = {weight: ("U8", size // 2), weight + ".absmax": ("U8" if state.double else "F32", blocks)}
            if state.double:
                expected[weight + ".nested_absmax"] = ("F32", -(-blocks // q.NESTED_BLOCK))
            for tensor, (dtype, count) in expected.items():
                found, shape = info(tensor)
                if found != dtype or math.prod(shape) != count:
                    raise UserError(
                        f"{names[tensor]}: tensor {tensor!r} is {found} {list(shape)}; the quant state of a "
                        f"{state.type} weight {list(state.shape)} in blocks of {state.block} needs {count:,} "
                        f"{dtype} values there"
                    )
        for name in names:
            if name.endswith(".SCB") or name.endswith(".weight_format"):
                raise UserError(f"{names[name]}: tensor {name!r} is a bitsandbytes 8-bit weight's; nnx reads 4-bit")
            dtype, shape = info(name)
            if dtype == "U8" and name not in self.states and self.auxiliary(name) is None:
                raise UserError(
                    f"{names[name]}: tensor {name!r} holds packed bitsandbytes codes (uint8 {list(shape)}) but "
                    f"its quant state {name + STATE + 'nf4'!r} (or fp4) is missing"
                )

    def auxiliary(self, name: str) -> str | None:
        """The quantised weight whose scales, maps or state `name` holds, or None."""
        if STATE in name:
            return name[: name.index(STATE)]
        for suffix in AUXILIARY:
            if name.endswith(suffix) and name.removesuffix(suffix) in self.states:
                return name.removesuffix(suffix)
        return None


def parts(state: State, read: Any, name: str) -> dict[str, np.ndarray]:
    """Weight `name` in `nnx.QuantizedKernel`'s layout (`read(tensor) -> array`), as stored: no code changes."""
    nested = (read(name + ".nested_absmax"), np.float32(state.offset)) if state.double else ()
    return q.from_bitsandbytes(read(name).reshape(-1), read(name + ".absmax").reshape(-1), state.shape, *nested)


def dequantized(state: State, read: Any, name: str) -> np.ndarray:
    """Weight `name` `[out, in]` in float32, as `dequantize_4bit` computes it."""
    absmax = read(name + ".absmax").reshape(-1)
    if state.double:
        absmax = q.undo_double_quantize(absmax, read(name + ".nested_absmax"), np.float32(state.offset))
    return q.dequantize_4bit(read(name).reshape(-1), absmax, state.type, state.shape)


def config(options: Mapping[str, Any], compute: str) -> dict[str, Any]:
    """`quantization_config` for a directory written with `model.quantize` `options`, as `transformers` saves
    a `BitsAndBytesConfig(load_in_4bit=True)`."""
    return {
        "_load_in_4bit": True,
        "_load_in_8bit": False,
        "bnb_4bit_compute_dtype": compute,
        "bnb_4bit_quant_storage": "uint8",
        "bnb_4bit_quant_type": options["type"],
        "bnb_4bit_use_double_quant": bool(options.get("double_quant", True)),
        "llm_int8_enable_fp32_cpu_offload": False,
        "llm_int8_has_fp16_weight": False,
        "llm_int8_skip_modules": None,
        "llm_int8_threshold": 6.0,
        "load_in_4bit": True,
        "load_in_8bit": False,
        "quant_method": "bitsandbytes",
    }


STATE_BYTES = 256  # a written quant state's JSON, padded with spaces (its length is in the header before it is known)


def layout(name: str, shape: tuple[int, int], kind: str, block: int, double: bool) -> dict[str, tuple[tuple, str]]:
    """`{tensor: (shape, dtype)}` of the tensors :func:`tensors` writes for weight `name` of PyTorch shape
    `shape`, in the order it writes them."""
    n = math.prod(shape)
    out = {name: ((n // 2, 1), "uint8"), name + ".absmax": ((n // block,), "uint8" if double else "float32")}
    if double:
        out[name + ".nested_absmax"] = ((-(-n // block // q.NESTED_BLOCK),), "float32")
        out[name + ".nested_quant_map"] = ((256,), "float32")
    out[name + ".quant_map"] = ((16,), "float32")
    out[name + STATE + kind] = ((STATE_BYTES,), "uint8")
    return out


def tensors(
    name: str, weight: np.ndarray, kind: str, block: int, double: bool, dtype: str
) -> Iterator[tuple[str, np.ndarray]]:
    """The tensors `transformers` saves for weight `name` (`[out, in]`, any float dtype, `dtype` its name)
    quantised by bitsandbytes' `quantize_4bit(weight, blocksize=block, compress_statistics=double,
    quant_type=kind)`, in :func:`layout`'s order."""
    packed, absmax = q.quantize_4bit(weight, kind, block)
    state = {"quant_type": kind, "blocksize": block, "dtype": dtype, "shape": list(weight.shape)}
    yield name, packed.reshape(-1, 1)
    if double:
        codes, nested, offset = q.double_quantize(absmax)
        state |= {"nested_blocksize": q.NESTED_BLOCK, "nested_dtype": "float32", "nested_offset": float(offset)}
        yield name + ".absmax", codes
        yield name + ".nested_absmax", nested
        yield name + ".nested_quant_map", q.dynamic_code().copy()
    else:
        yield name + ".absmax", absmax
    yield name + ".quant_map", q.code(kind).copy()
    text = json.dumps(state).encode()
    yield name + STATE + kind, np.frombuffer(text + b" " * (STATE_BYTES - len(text)), np.uint8).copy()


def quantizes(name: str, shape: tuple[int, ...]) -> bool:
    """Whether `transformers` stores tensor `name` in 4 bits under a `BitsAndBytesConfig`: the weight of an
    attention or MLP projection (its `nn.Linear` s, but a mixture's experts, which it keeps as 3-D tensors)."""
    return len(shape) == 2 and name.endswith("_proj.weight") and ".experts." not in name
