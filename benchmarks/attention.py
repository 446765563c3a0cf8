"""The training attention, each implementation and pass in a process of its own: compile and run time apart.

For every shape, implementation and pass (the output alone, `forward`; the gradients of `sum(o * cotangent)`
with respect to q, k and v, `backward`), a child process lowers, compiles, runs once and then `--repeats`
times, and prints each phase as it ends; the parent gives it `--timeout` seconds and prints one row: trace
and lowering, XLA's compilation, the first call, the fastest call (and its GFLOP/s), the compiled program's
temporary memory, how many matrix products it holds, and the largest difference of its output and query
gradient from XLA's (jax.nn). A child cut off by its time limit is reported with the phase it was in, so a
program that does not finish says whether it compiles or runs forever.

Implementations: `jax-xla` (`jax.nn.dot_product_attention`, XLA's, saving the weights), `xla` and `core`
(`transformer_lm`'s `model.attention: xla` and `core`), and on a GPU `cudnn` (cuDNN's fused kernel, what
`auto` takes there in 16-bit floats) and `tokamax` (its Pallas flash attention, where the package is
installed: see benchmarks/gpu_wheels.sh). `core-closed` is the core under the harness this script had
before (the cotangent closed over, so a constant of the program): at the GPT shape XLA folds it into
constants, on CPU 12 s of compiling for XLA's attention against 1.7 s with it as an argument.

Shapes: `heldout` (Qwen2-like: 8 query heads on 2 key-value heads, length 1,024, batch 2), `smollm2` (9 on 3,
length 256, batch 4), `gpt` (GPT-2 small: 12 heads of 64, length 1,024, batch 16). Defaults: every shape and
implementation in bfloat16 on a GPU; heldout and smollm2, no GPU implementation, float32 on a CPU.

    python benchmarks/attention.py [--shapes gpt] [--implementations core,cudnn] [--dtype bfloat16]
        [--repeats 10] [--timeout 90] [--xla-flags=--xla_gpu_autotune_level=0]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {  # batch, length, query heads, key-value heads, head dim
    "heldout": (2, 1024, 8, 2, 64),
    "smollm2": (4, 256, 9, 3, 64),
    "gpt": (16, 1024, 12, 12, 64),
}
IMPLEMENTATIONS = ("jax-xla", "xla", "core", "core-closed", "cudnn", "tokamax")
GPU_ONLY = ("cudnn", "tokamax")
PASSES = ("forward", "backward")


# The child: one implementation, one pass
# ------------------------------------------------------------------------------


def attention_function(name: str):
    """`(q, k, v) -> o` for implementation `name`, causal."""
    import jax

    if name == "jax-xla":
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    if name == "tokamax":
        import tokamax

        return lambda q, k, v: tokamax.dot_product_attention(q, k, v, is_causal=True)
    if name == "cudnn":
        return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    import nnx
    from nnx_cli.models.transformer import Attention, architecture

    def attend(q, k, v):  # transformer_lm's own dispatch: one layer's attention, its projections left out
        heads, d = q.shape[2:]
        options = dict(num_layers=1, num_heads=heads, num_kv_heads=k.shape[2], head_dim=d, embed_dim=heads * d,
                       mlp_dim=None, mlp="gelu", qkv_bias=False, qk_norm=False, bias=False, norm="layernorm",
                       norm_eps=1e-5, positions="rope", rope_theta=1e4, rope_scaling=None, dropout=0.0,
                       attention_dropout=0.0, remat="none", scan_layers=False, dtype=str(q.dtype))  # fmt: skip
        arch = architecture(**options, attention=name.removesuffix("-closed"))
        layer = Attention(arch, ctx=nnx.context(0))
        return layer._causal(q, k, v, deterministic=True, ctx=None)

    return attend


def child(shape: str, name: str, which: str, dtype: str, repeats: int, out: str) -> None:
    """Lower, compile and run one pass, printing each phase's seconds as one JSON line when it ends."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def say(**fields) -> None:
        print(json.dumps(fields), flush=True)

    b, t, h, kv, d = SHAPES[shape]
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, h, d), dtype)
    k = jax.random.normal(keys[1], (b, t, kv, d), dtype)
    v = jax.random.normal(keys[2], (b, t, kv, d), dtype)
    cotangent = jax.random.normal(keys[3], (b, t, h, d), dtype)
    attend = attention_function(name)
    if which == "forward":
        fn, args = jax.jit(attend), (q, k, v)
    elif name.endswith("-closed"):  # the cotangent a constant of the program, as this script had it
        fn = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) * cotangent), argnums=(0, 1, 2)))
        args = (q, k, v)
    else:
        loss = lambda q, k, v, c: jnp.sum(attend(q, k, v).astype(jnp.float32) * c)  # noqa: E731
        fn, args = jax.jit(jax.grad(loss, argnums=(0, 1, 2))), (q, k, v, cotangent)
    start = time.perf_counter()
    lowered = fn.lower(*args)
    say(phase="lower", seconds=time.perf_counter() - start)
    start = time.perf_counter()
    compiled = lowered.compile()
    say(phase="compile", seconds=time.perf_counter() - start)
    text = compiled.as_text()
    memory = compiled.memory_analysis()
    temp = getattr(memory, "temp_size_in_bytes", None) if memory is not None else None
    say(phase="program", dots=text.count(" dot("), fused_attention="__cudnn$fmha" in text,
        custom_calls=text.count("custom-call("), temp_bytes=temp)  # fmt: skip
    start = time.perf_counter()
    result = jax.block_until_ready(compiled(*args))
    say(phase="first", seconds=time.perf_counter() - start)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(compiled(*args))
        best = min(best, time.perf_counter() - start)
    stats = jax.devices()[0].memory_stats() or {}
    say(phase="run", ms=best * 1e3, peak_bytes=stats.get("peak_bytes_in_use"))
    o = result if which == "forward" else result[0]  # the output, or the query gradient
    np.save(out, np.asarray(o.astype(jnp.float32)))


# The parent: a process per part, a table
# ------------------------------------------------------------------------------


def run_part(shape: str, name: str, which: str, dtype: str, args, tmp: Path) -> dict:
    out = tmp / f"{shape}-{name}-{which}.npy"
    command = [sys.executable, __file__, "--child", shape, name, which, dtype, str(args.repeats), str(out)]
    env = dict(os.environ)
    if args.xla_flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {args.xla_flags}".strip()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env, cwd=ROOT)
        stdout, status = done.stdout, ("ok" if done.returncode == 0 else f"exit {done.returncode}")
        stderr = done.stderr
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr, status = "", f"timed out after {args.timeout} s"
    part = {"status": status, "output": out if out.exists() else None}
    for line in stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            part[record.pop("phase")] = record
    if status != "ok":
        phases = [p for p in ("lower", "compile", "program", "first", "run") if p in part]
        cut = {"lower": "compiling", "compile": "inspecting", "program": "the first call", "first": "the repeats"}
        part["where"] = cut.get(phases[-1], "?") if phases else "tracing"
        part["error"] = (stderr.strip().splitlines() or [""])[-1][:120]
    return part


def difference(a: Path | None, b: Path | None) -> str:
    import numpy as np

    if a is None or b is None:
        return "-"
    return f"{float(np.max(np.abs(np.load(a) - np.load(b)))):.1e}"


def seconds(part: dict, phase: str) -> str:
    return f"{part[phase]['seconds']:.2f}" if phase in part else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=6, help=argparse.SUPPRESS)
    parser.add_argument("--shapes", default=None, help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--implementations", default=None, help=f"of {', '.join(IMPLEMENTATIONS)}")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default=None)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=90.0, help="seconds for each part's process")
    parser.add_argument("--xla-flags", default="", help="added to XLA_FLAGS in the children")
    args = parser.parse_args()
    if args.child:
        sys.path.insert(0, str(ROOT))  # nnx_cli from this checkout
        shape, name, which, dtype, repeats, out = args.child
        return child(shape, name, which, dtype, int(repeats), out)

    import jax

    gpu = jax.default_backend() == "gpu"
    shapes = (args.shapes or (",".join(SHAPES) if gpu else "heldout,smollm2")).split(",")
    names = (args.implementations or ",".join(n for n in IMPLEMENTATIONS if gpu or n not in GPU_ONLY)).split(",")
    for option, chosen, known in (("--shapes", shapes, SHAPES), ("--implementations", names, IMPLEMENTATIONS)):
        unknown = sorted(set(chosen) - set(known))
        if unknown:
            parser.error(f"{option}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    dtype = args.dtype or ("bfloat16" if gpu else "float32")
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, {dtype}, each part's process limited to "
          f"{args.timeout:.0f} s{', XLA_FLAGS += ' + args.xla_flags if args.xla_flags else ''}; "
          f"load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="nnx-attention-") as tmp:
        for shape in shapes:
            b, t, h, kv, d = SHAPES[shape]
            flops = {"forward": 4 * b * h * t * t * d / 2, "backward": 3 * 4 * b * h * t * t * d / 2}  # causal half
            print(f"\n{shape}: batch {b}, length {t}, heads {h} on {kv}, head dim {d}")
            print("| attention | pass | lower s | compile s | first call s | fastest ms | GFLOP/s | temp MiB | dots "
                  "| fused | max diff vs jax-xla |")  # fmt: skip
            print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
            reference = {}
            for name in names:
                for which in PASSES if name != "core-closed" else ("backward",):  # its forward pass is core's
                    part = run_part(shape, name, which, dtype, args, Path(tmp))
                    if name == "jax-xla":
                        reference[which] = part["output"]
                    program = part.get("program", {})
                    run = part.get("run", {})
                    ms = f"{run['ms']:.2f}" if run else "-"
                    rate = f"{flops[which] / run['ms'] / 1e6:.0f}" if run else "-"
                    temp = f"{program['temp_bytes'] / 2**20:.0f}" if program.get("temp_bytes") is not None else "-"
                    status = "" if part["status"] == "ok" else f" ({part['status']} in {part['where']}) {part['error']}"
                    print(f"| {name}{status} | {which} | {seconds(part, 'lower')} | {seconds(part, 'compile')} | "
                          f"{seconds(part, 'first')} | {ms} | {rate} | {temp} | {program.get('dots', '-')} | "
                          f"{'yes' if program.get('fused_attention') else 'no'} | "
                          f"{difference(part['output'], reference.get(which))} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
