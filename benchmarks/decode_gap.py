"""How far bfloat16 logits decoded from a key-value cache are from a full pass's, and why: one table per process.

tests/test_lm_decoding.py::test_bfloat16_cached_logits_agree_with_a_full_pass_to_1_percent_of_their_spread asks
the cached logits of a small bfloat16 `transformer_lm` (weights x10, "lively") to be within 1% of the full
pass's spread. On a CPU the two are bit-identical; on an H200 they were 1.28 apart against a bound of 0.114. On
a GPU `model.attention: auto` runs the full pass and the prefill in cuDNN's fused kernel (more than one query)
while `decode` writes attention out in einsums against the cache. This script builds the test's model, its
sequence and its jitted cached loop, and compares (each row: the largest and the mean |difference|, the test's
bound 1% of the reference's std, how many of the 2 x 28 (batch, position) rows of logits are over it and how
many bit-identical, and the first that differs):

- for each `model.attention` (auto, core, xla; cudnn on a GPU): the full pass against cached decoding of the
  same model. The core and xla take the same way through attention as `decode` does
  (`unnormalized_softmax`): bit-identical there means the cache is written and read right;
- two full passes, core against cudnn: how far two valid kernels are apart at this amplification;
- each bfloat16 full pass and cached run against the float32 model's full pass (same weights): a cached run no
  further from float32 than the full pass is rounding, not a bug.

Then the model's products (its projections' shapes) of every row at once against the first rows alone, as a
decode step multiplies them: how many bfloat16 outputs differ (none on a CPU). Then the first table again from a
child process with `XLA_FLAGS += --xla_allow_excess_precision=false` (XLA's default lets it keep bfloat16
intermediates in float32 where it fuses them, which may differ between the two programs).
Matrix products in float32 run at `highest` precision, as in the test session (tests/conftest.py); the tests'
fast-compile flags are not applied unless given with `--xla-flags`.

    python benchmarks/decode_gap.py [--xla-flags="--xla_backend_optimization_level=0"] [--attentions core,cudnn]
                                    [--no-child]

Both tables take about 70 s on 2 CPU cores, most of it compiling the cached loops (27 decode steps
unrolled, as the test has them).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEQ_LEN, VOCAB, PROMPT, BATCH = 32, 257, 5, 2  # tests/test_lm_decoding.py's model, sequence and prompt
SMALL = dict(num_layers=2, num_heads=2, embed_dim=32, dropout=0.0)
ATTENTIONS = ("auto", "core", "xla", "cudnn")
NO_EXCESS_PRECISION = "--xla_allow_excess_precision=false"


# The logits, as the test computes them
# ------------------------------------------------------------------------------


def model_def(attention: str, dtype: str):
    """`(params, moduledef)` of the test's model with `model.attention: attention`, weights x10 ("lively")."""
    import jax

    import nnx
    from nnx_cli.models.transformer_lm import TransformerLM

    model = TransformerLM((SEQ_LEN,), VOCAB, **SMALL, dtype=dtype, attention=attention, ctx=nnx.context(0))
    params, moduledef = model.partition(nnx.Param)
    return jax.tree.map(lambda w: 10.0 * w, params), moduledef


def full_logits(moduledef, params, sequence):
    """The logits after positions `PROMPT - 1 .. SEQ_LEN - 1` from one pass without a cache: `[batch, 28, vocab]`."""
    import jax

    run = jax.jit(lambda p, t: moduledef.apply(p).logits(t)[0][..., :VOCAB])
    return run(params, sequence)[:, PROMPT - 1 :]


def cached_logits(moduledef, params, sequence):
    """The same logits from the test's jitted loop: the prompt prefilled (position `PROMPT - 1`'s row), then one
    `decode` per position."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def cached(params, sequence):
        model = moduledef.merge(params)
        model.init_cache(BATCH, SEQ_LEN)
        logits = [model.prefill(sequence[:, :PROMPT], jnp.full((BATCH,), PROMPT))]
        for i in range(PROMPT, SEQ_LEN):
            logits.append(model.decode(sequence[:, i], jnp.full((BATCH,), i)))
        return jnp.stack(logits, axis=1)[..., :VOCAB]

    return cached(params, sequence)


# The table
# ------------------------------------------------------------------------------


def compare(label: str, logits, reference) -> str:
    """One row: `logits` against `reference` (both `[batch, 28, vocab]`), the bound 1% of `reference`'s std."""
    import numpy as np

    logits, reference = np.asarray(logits, np.float32), np.asarray(reference, np.float32)
    diff = np.abs(logits - reference)
    bound = 0.01 * float(np.std(reference))
    rows = diff.max(axis=-1)  # [batch, 28]: each (batch, position) row's largest difference
    differing = np.argwhere(rows > 0)
    first = f"({differing[0][0]}, {differing[0][1] + PROMPT - 1})" if len(differing) else "none"
    verdict = "ok" if diff.max() <= bound else "**over**"
    return (
        f"| {label} | {diff.max():.4g} | {diff.mean():.3g} | {bound:.4g} ({verdict}) | {int((rows > bound).sum())} "
        f"| {int((rows == 0).sum())} / {rows.size} | {first} |"
    )


def table(title: str, attentions: tuple[str, ...] = ATTENTIONS) -> None:
    """Computes every comparison in this process and prints them as one markdown table."""
    import jax
    import jax.numpy as jnp
    import jaxlib

    jax.config.update("jax_default_matmul_precision", "highest")  # as the test session's (tests/conftest.py)
    gpu = jax.default_backend() == "gpu"
    device = jax.devices()[0]
    print(f"\n## {title}\n")
    print(f"backend {jax.default_backend()}, device {device.device_kind}, jax {jax.__version__}, "
          f"jaxlib {jaxlib.__version__}, XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}\n", flush=True)  # fmt: skip
    sequence = jax.random.randint(jax.random.key(3), (BATCH, SEQ_LEN), 0, VOCAB)
    params, float32_def = model_def("core", "float32")  # the reference; the same weights as every bfloat16 model
    float32 = full_logits(float32_def, params, sequence)
    rows, notes, full, cached = [], [], {}, {}
    for attention in attentions:
        if attention == "cudnn" and not gpu:
            notes.append(f"cudnn rows skipped: cuDNN's kernel needs a GPU (backend {jax.default_backend()})")
            continue
        try:
            _, moduledef = model_def(attention, "bfloat16")
            summary = moduledef.merge(params).attention_summary()
            full[attention] = full_logits(moduledef, params, sequence)
            cached[attention] = cached_logits(moduledef, params, sequence)
        except Exception as e:  # a kernel that does not run here: say so, keep the other rows
            notes.append(f"{attention} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            continue
        notes.append(f"{attention}: {summary}")
        rows.append(compare(f"{attention}: cached vs full", cached[attention], full[attention]))
    if "core" in full and "cudnn" in full:
        rows.append(compare("full core vs full cudnn (no cache)", full["cudnn"], full["core"]))
    for attention in full:
        rows.append(compare(f"{attention}: full vs float32 full", full[attention], float32))
        rows.append(compare(f"{attention}: cached vs float32 full", cached[attention], float32))
    print("| comparison | max abs diff | mean abs diff | bound: 1% of reference std | rows over bound "
          "| bit-identical rows | first differing (batch, position) |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    print(f"\nPosition {PROMPT - 1} is the prefill's row (the logits after the {PROMPT}-token prompt), "
          f"{PROMPT} .. {SEQ_LEN - 1} the decode steps'. The reference (second) of each pair sets the bound. "
          f"float32 std {float(jnp.std(float32)):.3g}.")  # fmt: skip
    for note in notes:
        print(f"- {note}")
    sys.stdout.flush()


def products() -> None:
    """The model's bfloat16 products (its projections' shapes) of all `BATCH x SEQ_LEN` rows, as a full pass
    multiplies them, against the same first `BATCH` rows alone, as a decode step does: how many outputs differ.
    On a CPU none; a GPU may accumulate other shapes in another order (another kernel, split sums), and one
    output a unit apart in bfloat16 is what a weights-x10 model turns into the gap above."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    width, rows = SMALL["embed_dim"], BATCH * SEQ_LEN
    print("\n| product (rows x inner x out) | outputs that differ, first rows alone against all rows |")
    print("| --- | --- |")
    for inner, out in ((width, 3 * width), (width, width), (width, 4 * width), (4 * width, width), (width, VOCAB)):
        kx, kw = jax.random.split(jax.random.key(inner * 1000 + out))
        x = (10 * jax.random.normal(kx, (rows, inner))).astype(jnp.bfloat16)
        w = jax.random.normal(kw, (inner, out)).astype(jnp.bfloat16)
        product = jax.jit(lambda x, w: x @ w)
        whole, alone = np.asarray(product(x, w)[:BATCH], np.float32), np.asarray(product(x[:BATCH], w), np.float32)
        print(f"| {rows} x {inner} x {out} against {BATCH} rows | {int((whole != alone).sum())} of {alone.size} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    only = f"only the table with XLA_FLAGS += {NO_EXCESS_PRECISION} (what the parent runs in its child)"
    parser.add_argument("--no-excess-precision", action="store_true", help=only)
    parser.add_argument("--xla-flags", default="", help="added to XLA_FLAGS here and in the child")
    parser.add_argument("--attentions", default=",".join(ATTENTIONS), help="which model.attention rows (each "
                        "compiles its cached loop: about 20 s apiece on an H200)")  # fmt: skip
    parser.add_argument("--no-child", action="store_true", help="the default table only")
    args = parser.parse_args()
    attentions = tuple(a for a in args.attentions.split(",") if a)
    if set(attentions) - set(ATTENTIONS):
        parser.error(f"--attentions: each one of {', '.join(ATTENTIONS)}")
    added = [args.xla_flags] if args.xla_flags else []
    if args.no_excess_precision and NO_EXCESS_PRECISION not in os.environ.get("XLA_FLAGS", ""):
        added.append(NO_EXCESS_PRECISION)
    if added:  # before JAX starts its backend, which reads them once; a child inherits them
        os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), *added]).strip()
    sys.path.insert(0, str(ROOT))  # nnx and nnx_cli from this checkout
    if args.no_excess_precision:
        return table(f"Excess precision off ({NO_EXCESS_PRECISION})", attentions)
    table("XLA's default excess precision", attentions)
    products()  # plain products: excess precision (the child's question) has no fusion to act on there
    sys.stdout.flush()
    if args.no_child:
        return
    # The child: the parent's environment (its --xla-flags included); it turns excess precision off itself.
    child = [sys.executable, __file__, "--no-excess-precision", f"--attentions={args.attentions}"]
    done = subprocess.run(child, env=os.environ, cwd=ROOT)
    if done.returncode:
        print(f"\nthe child with {NO_EXCESS_PRECISION} exited {done.returncode}")


if __name__ == "__main__":
    main()
