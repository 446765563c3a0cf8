"""What llama.cpp itself computes from `nnx-export --format gguf` files, against nnx on the same runs.

tests/test_gguf.py checks that our files equal what llama.cpp's converter writes for the same model directory. This
runs the files in llama.cpp (through `llama-cpp-python`, in the reference virtualenv), including what the converter
never sees: runs from scratch with nnx's `bytes` tokenizer (a GPT-2-shaped one and a Llama-shaped one, trained a
few hundred steps on a generated text) and LoRA and QLoRA fine-tunes of the tiny model directories under
tests/fixtures/hf. Each run is exported at f32 and q8_0.

The Gemma 2 fixture is given query_pre_attn_scalar equal to its head size first (llama.cpp scales attention by the
head size; the export notes the difference). For each file:

- tokens: llama.cpp's tokenization of a few texts (`add_bos` as the file says) equals the run's tokenizer's;
- logits: llama.cpp's over a line of text (the ids nnx's tokenizer gives) against nnx's full pass, the largest
  difference relative to the largest logit;
- greedy: 32 greedy tokens after a prompt, llama.cpp's against `nnx-generate --temperature 0`'s; how many agree
  before the first difference.

llama.cpp keeps its key-value cache in f32 here (its default is f16, which alone moves an f32 file's logits by
up to 1e-3 of the largest). Targets: tokens equal everywhere; at f32, logits within 1e-3 of the largest (what is
left is llama.cpp's own arithmetic, its GELU read from a float16 table among it) and every greedy token equal; at
q8_0 the figures are printed, not judged (its rounding is the point).

    /work/refvenv/bin/pip install llama-cpp-python gguf     # builds llama.cpp once (10-20 minutes)
    python benchmarks/gguf_llama.py --reference /work/refvenv/bin/python

Exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
FIXTURES = ROOT / "tests" / "fixtures" / "hf"
TINY_LM = str(ROOT / "configs" / "tiny_lm.yaml")
SCRATCH = ["data.source=book.txt", "data.eval_split=null", "train.steps=300", "train.log_every=100"]
LORA = ["data.source=book.txt", "data.eval_split=null", "data.seq_len=32", "train.steps=20", "train.batch_size=4",
        "train.log_every=10", "train.eval_every=100", "optimizer.learning_rate=1.0e-2"]  # fmt: skip
LLAMA_SHAPE = ["model.positions=rope", "model.norm=rmsnorm", "model.mlp=swiglu", "model.bias=false",
               "model.num_kv_heads=2", "model.tie_embeddings=false"]  # fmt: skip
CASES = {
    # name: (config, overrides): a from-scratch run on nnx's bytes tokenizer, or a fine-tune of a fixture
    "scratch-gpt2": (TINY_LM, SCRATCH),
    "scratch-llama": (TINY_LM, [*SCRATCH, *LLAMA_SHAPE]),
    "lora-llama": ("lora.yaml", [*LORA, f"model.pretrained={FIXTURES / 'llama'}"]),
    "lora-qwen2": ("lora.yaml", [*LORA, f"model.pretrained={FIXTURES / 'qwen2'}"]),
    "lora-gemma2": ("lora.yaml", [*LORA, "model.pretrained={work}/gemma2"]),  # made by `gemma2`, below
    "qlora-llama": ("lora.yaml", [*LORA, f"model.pretrained={FIXTURES / 'llama_bnb4bit'}"]),
}
LORA_CONFIG = "model: {name: transformer_lm, lora: {rank: 8}}\ndata: {text_key: text}\n"
TEXTS = ["the river ran past the old mill", "Hello, world! 123 \u00e9t\u00e9 -- caf\u00e9", "  two  spaces\nand a line"]
PROMPT = "the miller sang of"
GREEDY = 32
REFERENCE = r"""
import json, sys
import numpy as np
from llama_cpp import Llama

job = json.loads(sys.stdin.read())
# the key-value cache in f32 (type 0; llama.cpp's default is f16), so that an f32 file's logits measure the file
llm = Llama(job["file"], n_ctx=256, logits_all=True, verbose=False, n_threads=2, seed=0, type_k=0, type_v=0)
out = {"tokens": [llm.tokenize(t.encode(), add_bos=True, special=False) for t in job["texts"]]}
llm.eval(job["ids"])
out["logits"] = np.asarray(llm.scores[: llm.n_tokens]).tolist()
llm.reset()
llm.eval(job["prompt"])
greedy = []
for _ in range(job["n"]):
    greedy.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
    llm.eval(greedy[-1:])
out["greedy"] = greedy
print(json.dumps(out))
"""


def book(path: Path) -> None:
    """Lines of words drawn from a small vocabulary: a text a tiny model learns something of in a few hundred steps."""
    rng = random.Random(0)
    words = "the river ran past the old mill and the boats went by while the miller sang of rain and bread".split()
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(12)) for _ in range(3000)) + "\n")


def gemma2(work: Path) -> None:
    """The Gemma 2 fixture with query_pre_attn_scalar at its head size: llama.cpp scales attention by the head
    size (the fixture's 24 against 16 makes other logits, and the export says so in a note)."""
    shutil.copytree(FIXTURES / "gemma2", work / "gemma2")
    config = json.loads((work / "gemma2" / "config.json").read_text())
    config["query_pre_attn_scalar"] = config["head_dim"]
    (work / "gemma2" / "config.json").write_text(json.dumps(config))


def run(command: list[str], cwd: Path, what: str) -> subprocess.CompletedProcess:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{what} failed:\n{result.stderr[-4000:]}")
    return result


def train(work: Path, name: str) -> Path:
    config, overrides = CASES[name]
    overrides = [o.format(work=work) for o in overrides]
    run([str(BIN / "nnx-train"), config, *overrides, "--workdir", name], work, f"nnx-train ({name})")
    return work / name


def ours(workdir: Path) -> dict:
    """nnx's tokens of TEXTS, its logits over the first text, its prompt ids and greedy tokens (`nnx-generate`)."""
    import jax

    from nnx_cli.data.tokenizers import load_tokenizer
    from nnx_cli.lm import language_model, restore_parameters
    from nnx_cli.workdir import open_run

    r = open_run(workdir)
    exp = language_model(r, "")  # (imports the readers of model directories, the tokenizer's among them)
    tokenizer = load_tokenizer(r.cfg.data.tokenizer, r.cfg.model.pretrained)
    tokens = [[int(i) for i in tokenizer.encode(text)] for text in TEXTS]
    _, params = restore_parameters(r, exp, jax.devices("cpu")[0])
    logits = np.asarray(exp.moduledef.merge(params).logits(np.asarray([tokens[0]], np.int32)), np.float32)[0]
    drawn = json.loads(run([str(BIN / "nnx-generate"), str(workdir), "--prompt", PROMPT, "--temperature", "0",
                            "--max-tokens", str(GREEDY), "--json"], workdir.parent, "nnx-generate").stdout)  # fmt: skip
    return {"tokens": tokens, "logits": logits, "prompt": [int(i) for i in tokenizer.encode(PROMPT)],
            "greedy": drawn["tokens"][0]}  # fmt: skip


def theirs(reference: str, gguf_file: Path, mine: dict) -> dict:
    job = {"file": str(gguf_file), "texts": TEXTS, "ids": mine["tokens"][0], "prompt": mine["prompt"], "n": GREEDY}
    result = subprocess.run([reference, "-c", REFERENCE], input=json.dumps(job), capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"llama.cpp could not run {gguf_file}:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout)


def agreeing(a: list[int], b: list[int]) -> int:
    """How many tokens agree before the first difference (nnx's may end early, at an end-of-text token)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", required=True, help="python of a virtualenv with llama-cpp-python")
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
    parser.add_argument("--dtype", nargs="+", default=["f32", "q8_0"], choices=["f32", "f16", "bf16", "q8_0"])
    args = parser.parse_args()
    missed = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        book(work / "book.txt")
        (work / "lora.yaml").write_text(LORA_CONFIG)
        gemma2(work)
        print(f"{'run':<14} {'type':<5} {'tokens':<7} {'logits':>9} {'greedy':>7}  arch")
        for name in args.cases:
            workdir = train(work, name)
            mine = ours(workdir)
            for dtype in args.dtype:
                out = work / f"{name}-{dtype}.gguf"
                wrote = run([str(BIN / "nnx-export"), name, "--format", "gguf", "--dtype", dtype, "--out", out.name],
                            work, "nnx-export").stderr  # fmt: skip
                arch = wrote.split("(")[1].split(",")[0] if "(" in wrote else "?"  # 'wrote F (llama, f32, ...'
                got = theirs(args.reference, out, mine)
                logits = np.asarray(got["logits"], np.float32)
                reference = mine["logits"][:, : logits.shape[-1]]  # nnx pads its vocabulary to a multiple of 128
                error = float(np.abs(logits - reference).max() / np.abs(reference).max())
                tokens = got["tokens"] == mine["tokens"]
                greedy = agreeing(mine["greedy"], got["greedy"])
                print(f"{name:<14} {dtype:<5} {'equal' if tokens else 'DIFFER':<7} {error:>9.1e} "
                      f"{greedy:>3}/{len(mine['greedy']):<3}  {arch}")  # fmt: skip
                if not tokens:
                    missed.append(f"{name} {dtype}: tokens differ: nnx {mine['tokens']} llama.cpp {got['tokens']}")
                if dtype == "f32" and (error > 1e-3 or greedy < len(mine["greedy"])):
                    missed.append(f"{name} f32: logits {error:.1e} of the largest, {greedy} greedy tokens agree")
    for line in missed:
        print("missed:", line)
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
