"""A fine-tuned run to one GGUF file: `nnx-export --format gguf` against the two-step route through llama.cpp.

The route a user has without it is two steps: our Hugging Face export of the run (`nnx-export RUN --out DIR`), then
llama.cpp's converter (`convert_hf_to_gguf.py DIR`, from llama.cpp's source, run with the reference virtualenv's
python, which has torch). This times both end to end on the same run, a LoRA fine-tune (one step) of a random model
shaped like Qwen2.5-0.5B (24 layers, 896 wide, 14 heads sharing 2 key-value heads, a 151,936-token vocabulary, tied
embeddings, bfloat16 on disk), at each `--dtype`, and reports wall time, file size and each route's peak resident
memory (the largest process of the route, from getrusage), each route twice in the order A B B A (`--rounds N`: that
N times), after one unmeasured run of each (`--warmup`), with the page cache's dirty pages written out before each
command (the means of the times, the largest peaks). Targets: ours at least 2x faster end to end, peak memory no
higher. The two files must be equal (the converter is told the pre-tokenizer name, as
tests/fixtures/make_gguf_fixtures.py does: the random model's tokenizer is not a real one) at f32, where both
start from the same float32 weights; at the other types the two-step route's Hugging Face export is in the base
model's bfloat16, as a user makes it, and ours quantises the merged float32 weights directly.

With `--transformers`, also the logits `transformers` computes from our f32 file (`gguf_file=`) against nnx's own
from the run, on a few tokens (transformers does not read every family's GGUF faithfully; it reads Qwen2's).

    python benchmarks/gguf.py --reference /work/refvenv/bin/python --llama-cpp LLAMA_CPP_SOURCE
    python benchmarks/gguf.py --reference ... --llama-cpp ... --size tiny --transformers   # a smoke test

Exit status 1 when a target is missed or the files differ.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

# this file's name is the gguf package's: drop its directory from the path, or `import gguf` finds this script
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SIZES = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1024),
}  # fmt: skip
QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
CONVERT = """
import sys
sys.path.insert(0, sys.argv[1])
import conversion.base
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
import convert_hf_to_gguf
convert_hf_to_gguf.main()
"""
MEASURED = """
import resource, subprocess, sys, time
start = time.perf_counter()
code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
seconds = time.perf_counter() - start
if code.returncode:
    sys.stderr.write(code.stderr[-4000:])
    raise SystemExit(code.returncode)
print(seconds, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""


def measured(command: list[str], cwd: Path, env: dict | None = None) -> tuple[float, int]:
    """Wall seconds and peak resident bytes of `command` (a process of its own, measured from outside)."""
    result = subprocess.run([sys.executable, "-c", MEASURED, *map(str, command)], cwd=cwd, capture_output=True,
                            text=True, env=env)  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, command))} failed:\n{result.stderr[-4000:]}")
    seconds, peak = result.stdout.split()
    return float(seconds), int(peak)


def model_dir(directory: Path, size: str) -> None:
    """A random Qwen2 of `size` in bfloat16, written tensor by tensor, and a small byte-level BPE tokenizer."""
    import ml_dtypes
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from nnx_cli.hf import families
    from nnx_cli.tensorfiles import write_safetensors

    shape = SIZES[size]
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": True, "hidden_act": "silu",
              "use_sliding_window": False, "bos_token_id": 0, "eos_token_id": 0, "dtype": "bfloat16",
              **shape}  # fmt: skip
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    family = families.FAMILIES["Qwen2ForCausalLM"]
    options = family.options(families.Config(config, "config.json"))
    shapes = families.layout(family.tensors(options, []), options["num_layers"])
    rng = np.random.default_rng(0)

    def tensors():
        for name, s in shapes.items():
            base = 1.0 if name.endswith("norm.weight") else 0.0
            yield name, (base + rng.standard_normal(s, np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    write_safetensors(directory, shapes, tensors(), "bfloat16")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])  # fmt: skip
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tokenizer.train_from_iterator([(ROOT / "README.md").read_text()[:20000]] * 3, trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>", "chat_template": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                "{% endif %}"}  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))


def fine_tune(work: Path, base: Path) -> Path:
    """One LoRA step on a few lines of text: a run whose export merges adapters into the base weights."""
    (work / "text.txt").write_text("\n".join(["the river ran past the old mill and the boats went by"] * 64))
    (work / "run.yaml").write_text(
        f"model: {{name: transformer_lm, pretrained: {base}, lora: {{rank: 8}}}}\n"
        "data: {source: text.txt, text_key: text, seq_len: 16, eval_split: null}\n"
        "train: {batch_size: 1, steps: 1, eval_every: 100}\n"
    )
    result = subprocess.run([str(BIN / "nnx-train"), "run.yaml", "--workdir", "run"], cwd=work, capture_output=True,
                            text=True)  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"nnx-train failed:\n{result.stderr[-4000:]}")
    return work / "run"


def same_file(a: Path, b: Path) -> bool:
    """Equal metadata and equal tensors."""
    from gguf import GGUFReader

    ra, rb = GGUFReader(a), GGUFReader(b)
    fields = lambda r: {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.")}  # noqa: E731
    tensors = lambda r: {t.name: (t.tensor_type, bytes(np.ascontiguousarray(t.data).data)) for t in r.tensors}  # noqa: E731
    return fields(ra) == fields(rb) and tensors(ra) == tensors(rb)


def transformers_check(reference: str, gguf_file: Path, run: Path) -> float:
    """The largest difference between transformers' logits from our f32 file and nnx's from the run, relative to
    the largest logit."""
    import jax

    from nnx_cli.lm import language_model, restore_parameters
    from nnx_cli.workdir import open_run

    ids = [[1, 17, 250, 33, 90, 412, 7, 5]]
    script = (
        "import sys, json, torch, transformers\n"
        "m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], gguf_file=sys.argv[2], "
        "dtype=torch.float32).eval()\n"
        "print(json.dumps(m(torch.tensor(json.loads(sys.argv[3]))).logits.tolist()))\n"
    )
    result = subprocess.run([reference, "-c", script, str(gguf_file.parent), gguf_file.name, json.dumps(ids)],
                            capture_output=True, text=True)  # fmt: skip
    if result.returncode != 0:
        raise SystemExit(f"transformers could not load {gguf_file}:\n{result.stderr[-3000:]}")
    theirs = np.asarray(json.loads(result.stdout), np.float32)
    r = open_run(run)
    exp = language_model(r, "")
    _, params = restore_parameters(r, exp, jax.devices("cpu")[0])
    ours = np.asarray(exp.moduledef.merge(params).logits(np.asarray(ids, np.int32)))[..., : theirs.shape[-1]]
    return float(np.abs(ours - theirs).max() / np.abs(theirs).max())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", required=True, help="python of a virtualenv with torch and transformers")
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree (its converter)")
    parser.add_argument("--size", choices=sorted(SIZES), default="qwen2.5-0.5b")
    parser.add_argument("--dtype", nargs="+", default=["bf16", "f16", "q8_0"], choices=["f32", "f16", "bf16", "q8_0"])
    parser.add_argument("--rounds", type=int, default=1, help="A B B A this many times (f32's 2 GB writes vary)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="unmeasured runs of each side first (this many each): "
        "a VM's first touch of memory it has not used for a while costs several times a later one",
    )
    parser.add_argument("--workdir", type=Path, help="keep the model and runs here (default: a temporary dir)")
    parser.add_argument("--transformers", action="store_true", help="also compare transformers' logits (f32)")
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="nnx-gguf-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    base = work / f"base-{args.size}"
    if not (base / "config.json").is_file():
        model_dir(base, args.size)
    run = work / "run" if (work / "run" / "checkpoints").is_dir() else fine_tune(work, base)
    env = {**os.environ, "PYTHONPATH": str(args.llama_cpp / "gguf-py")}
    failed = False
    print(f"{args.size}: {sum(1 for _ in base.glob('*.safetensors'))} weight file(s), "
          f"{sum(p.stat().st_size for p in base.glob('*.safetensors')) / 1e9:.2f} GB; run {run}")  # fmt: skip
    for dtype in args.dtype:
        # the export's directory is named as the base model's: the converter names the model (general.name,
        # size_label) from the directory as ours does from the base model's
        ours_file, hf_dir, theirs_file = (
            work / f"ours-{dtype}.gguf",
            work / f"hf-{dtype}" / base.name,
            work / f"theirs-{dtype}.gguf",
        )
        for path in (ours_file, theirs_file):
            path.unlink(missing_ok=True)
        shutil.rmtree(hf_dir.parent, ignore_errors=True)
        ours_runs, two_runs = [], []
        # unmeasured runs of each side first (--warmup), then A B B A; dirty pages flushed before each command
        order = [(side, False) for side in ("ours", "two-step") * args.warmup]
        order += [(side, True) for side in ("ours", "two-step", "two-step", "ours") * args.rounds]
        for side, kept in order:
            os.sync()
            if side == "ours":
                ours_file.unlink(missing_ok=True)
                timed = measured([BIN / "nnx-export", run, "--format", "gguf", "--dtype", dtype, "--out", ours_file],
                                 work)  # fmt: skip
                ours_runs += [timed] if kept else []
                continue
            theirs_file.unlink(missing_ok=True)
            shutil.rmtree(hf_dir.parent, ignore_errors=True)
            # the Hugging Face export in the base model's dtype, as a user makes it; in float32 for an f32 file
            hf = measured([BIN / "nnx-export", run, "--out", hf_dir, *(["--dtype", "float32"] if dtype == "f32"
                                                                      else [])], work)  # fmt: skip
            os.sync()
            conv = measured([args.reference, "-c", CONVERT, args.llama_cpp, hf_dir, "--outfile", theirs_file,
                             "--outtype", dtype], work, env)  # fmt: skip
            two_runs += [(hf, conv)] if kept else []
        ours_s, ours_m = statistics.mean(s for s, _ in ours_runs), max(m for _, m in ours_runs)
        hf_s, conv_s = (statistics.mean(r[i][0] for r in two_runs) for i in (0, 1))
        hf_m, conv_m = (max(r[i][1] for r in two_runs) for i in (0, 1))
        two_s, two_m = hf_s + conv_s, max(hf_m, conv_m)
        equal = same_file(ours_file, theirs_file) if dtype == "f32" else None  # else theirs rounds to bf16 first
        speedup = two_s / ours_s
        ok = speedup >= 2 and ours_m <= two_m and equal is not False
        failed |= not ok
        print(
            f"{dtype:>5}: ours {ours_s:6.1f} s ({', '.join(f'{s:.1f}' for s, _ in ours_runs)}), "
            f"{ours_m / 1e9:5.2f} GB peak, {ours_file.stat().st_size / 1e6:8.1f} MB"
            f" | two-step {two_s:6.1f} s ({', '.join(f'{h[0] + c[0]:.1f}' for h, c in two_runs)}; export {hf_s:.1f}"
            f" + converter {conv_s:.1f}), {two_m / 1e9:5.2f} GB peak "
            f"(export {hf_m / 1e9:.2f}, converter {conv_m / 1e9:.2f}), "
            f"{theirs_file.stat().st_size / 1e6:8.1f} MB | {speedup:.2f}x faster"
            f"{'' if equal is None else ', files equal' if equal else ', FILES DIFFER'} | {'ok' if ok else 'MISSED'}"
        )
    if args.transformers:
        f32 = work / "ours-f32.gguf"
        if not f32.is_file():
            subprocess.run([BIN / "nnx-export", run, "--format", "gguf", "--dtype", "f32", "--out", f32], check=True,
                           capture_output=True)  # fmt: skip
        error = transformers_check(args.reference, f32, run)
        print(f"transformers from our f32 file vs nnx from the run: logits equal to {error:.1e} of the largest")
        failed |= not error < 1e-4
    print(f"targets: >= 2x faster, peak memory no higher; {'missed' if failed else 'met'} (files in {work})")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
