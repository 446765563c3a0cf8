"""`nnx-generate` against `transformers`' `generate` on a Qwen2.5-0.5B-shaped model, CPU, batch 1.

Writes a model directory with the shapes of Qwen/Qwen2.5-0.5B-Instruct (random weights, as
benchmarks/hf_load.py does, plus a small tokenizer), then, in whole fresh processes, alternating:

- `nnx-generate DIR --prompt ... --max-tokens 128 --temperature 0 --json` (after one untimed run that fills
  the compilation cache: "warm"), and
- benchmarks/reference/transformers_generate.py in a virtualenv with torch + transformers (`--reference`,
  see tests/fixtures/README.md), float32 like nnx, greedy, 128 new tokens with its key-value cache.

Reports decode tokens/s (after the first token) of each, the whole command's wall time of each (imports,
loading and generation included), and whether the greedy tokens agree. Targets (issue "Open weights in"):
tokens/s at least transformers', whole command within 1.5x. Exit status 1 when a target is missed.

    python benchmarks/hf_generate.py --reference /tmp/refvenv/bin/python [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_load import write_model

ROOT = Path(__file__).resolve().parent.parent
PROMPT = "The river ran past the old mill, and the miller's daughter counted the boats"


def write_tokenizer(directory: Path) -> None:
    """A small byte-level BPE tokenizer (its ids all fit the model's vocabulary) and a generation config whose
    end-of-sequence id random weights practically never produce, so both sides draw all 128 tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1000, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator([PROMPT * 4] * 50, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"})
    )
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 151935}))


def timed(command: list[str], env: dict[str, str]) -> tuple[float, dict]:
    start = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - start
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{result.stderr}")
    return seconds, json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", required=True, help="python of a virtualenv with torch and transformers")
    parser.add_argument("--dir", type=Path, default=None, help="where to write the model (default: a temp dir)")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    directory = args.dir or Path(tempfile.mkdtemp(prefix="nnx-qwen-shaped-"))
    write_model(directory)
    write_tokenizer(directory)
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    nnx = [str(Path(sys.executable).parent / "nnx-generate"), str(directory), "--prompt", PROMPT,
           "--max-tokens", str(args.max_tokens), "--temperature", "0", "--json"]  # fmt: skip
    reference = [args.reference, str(ROOT / "benchmarks/reference/transformers_generate.py"), str(directory),
                 "--prompt", PROMPT, "--max-tokens", str(args.max_tokens)]  # fmt: skip
    timed(nnx, env)  # fills the compilation cache: the runs below are warm
    _, decode = timed([*reference, "--decode-only"], env)  # transformers' decode tokens/s, prefill separated
    walls: dict[str, list[float]] = {"nnx-generate": [], "transformers": []}
    speeds, outputs = [], {}
    for _ in range(args.runs):
        seconds, out = timed(nnx, env)
        walls["nnx-generate"].append(seconds)
        speeds.append(out["tokens_per_s"])
        outputs["nnx"] = out["tokens"][0]
        seconds, out = timed(reference, env)
        walls["transformers"].append(seconds)
        outputs["transformers"] = out["tokens"]
    ours, theirs = statistics.median(speeds), decode["tokens_per_s"]
    wall = {k: statistics.median(v) for k, v in walls.items()}
    print(f"model: {directory} (Qwen2.5-0.5B shapes, float32), batch 1, {args.max_tokens} new tokens, greedy")
    print("\n| | decode tokens/s | whole command s (median of runs) |")
    print("| --- | --- | --- |")
    print(f"| nnx-generate (warm compilation cache) | {ours:.1f} | {wall['nnx-generate']:.2f} |")
    print(f"| transformers generate ({decode['threads']} threads) | {theirs:.1f} | {wall['transformers']:.2f} |")
    same = outputs["nnx"] == outputs["transformers"]
    agree = next((i for i, (a, b) in enumerate(zip(outputs["nnx"], outputs["transformers"])) if a != b), None)
    print(f"\ntokens/s ratio nnx / transformers: {ours / theirs:.2f}x (target >= 1.0x)")
    print(f"whole command ratio: {wall['nnx-generate'] / wall['transformers']:.2f}x (target <= 1.5x)")
    print(f"greedy tokens identical: {same}" + ("" if same else f" (first difference at token {agree})"))
    ok = ours >= theirs and wall["nnx-generate"] <= 1.5 * wall["transformers"]
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
