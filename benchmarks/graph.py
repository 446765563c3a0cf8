"""Partition + merge of a 16-layer MLP: nnx versus flax.nnx split + merge.

Prints the time per round trip of each library and the speed-up ratio,
measured side by side in this process. The target is a ratio of at least 4.

    python benchmarks/graph.py [--layers 16] [--repeats 2000]
"""

import argparse
import timeit

import jax

import nnx


def time_per_call(fn, repeats: int) -> float:
    fn()  # warm up caches
    best = min(timeit.repeat(fn, number=repeats, repeat=5))
    return best / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args()

    ctx = nnx.context(0)
    model = nnx.Sequence([nnx.Linear(args.features, args.features, ctx=ctx) for _ in range(args.layers)])

    def nnx_round_trip():
        state, moduledef = model.partition()
        return moduledef.merge(state)

    ours = time_per_call(nnx_round_trip, args.repeats)
    print(f"nnx partition + merge:       {ours * 1e6:8.1f} us")

    try:
        from flax import nnx as flax_nnx
    except ImportError:
        print('flax is not installed (pip install -e ".[bench]"): no comparison')
        return

    rngs = flax_nnx.Rngs(0)
    flax_model = flax_nnx.Sequential(
        *[flax_nnx.Linear(args.features, args.features, rngs=rngs) for _ in range(args.layers)]
    )

    def flax_round_trip():
        graphdef, state = flax_nnx.split(flax_model)
        return flax_nnx.merge(graphdef, state)

    theirs = time_per_call(flax_round_trip, args.repeats)
    print(f"flax.nnx split + merge:      {theirs * 1e6:8.1f} us")
    ratio = theirs / ours
    print(f"speed-up over flax.nnx:      {ratio:8.2f}x  (target >= 4x: {'PASS' if ratio >= 4 else 'FAIL'})")


if __name__ == "__main__":
    jax.config.update("jax_platforms", "cpu")
    main()
