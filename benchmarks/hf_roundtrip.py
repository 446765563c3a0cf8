"""Fine-tune, sample, export, and ask `transformers` and `peft` the same questions: the answers must agree.

The round trip a user makes, checked against the live libraries (from a separate virtualenv, `--reference`;
tests/fixtures/README.md says how to make one):

1. a LoRA and a full fine-tune of the tiny Qwen2 fixture (tests/fixtures/hf/qwen2), LoRA fine-tunes of the
   Gemma 2 fixture (sliding and full layers, soft-capping, windows of 8 tokens that the chats cross) and of the
   Phi-3 fixture (fused projections: its adapter is a block adapter on qkv_proj and gate_up_proj), and LoRA
   fine-tunes of the mixtures of experts (tests/fixtures/hf/mixtral and qwen3_moe) adapting attention and every
   expert's projections, on a chat task of question/answer facts; each question asked with
   `nnx-generate RUN --chat --temperature 0 --json`;
2. `nnx-export` of each (merged, float32) and of each LoRA run's adapter (`--adapter`; not of the mixtures of
   experts, whose adapted experts PEFT has no module for);
3. the same questions asked of `transformers` (the merged exports) and of `peft` (the adapter on the base),
   greedy, through the same chat template: the generated ids must be identical, and the logits of a
   fixed batch equal to 1e-4 of the largest;
4. a Llama-style and a GPT-2-style `transformer_lm` trained from scratch (bytes tokenizer), exported, and
   continued by `transformers` from the same prompt as `nnx-generate`.

Exit status 1 on any disagreement.

    python benchmarks/hf_roundtrip.py --reference /tmp/refvenv/bin/python
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
FACTS = [
    ("Who keeps the bridge?", "The old guard."),
    ("When does the fiddler come?", "In spring."),
    ("What is the capital of the valley?", "The mill town."),
    ("Where does the river run?", "Past the mill."),
]
FIXTURE = ROOT / "tests/fixtures/hf/qwen2"
EXPERTS = "{rank: 4, targets: [q, k, v, o, experts]}"  # attention and each expert's projections: no PEFT adapter
FINE_TUNES = {  # run: (model directory, model.lora)
    "lora": (FIXTURE, "{rank: 4}"),
    "full": (FIXTURE, None),
    "gemma2-lora": (ROOT / "tests/fixtures/hf/gemma2", "{rank: 4}"),
    "phi3-lora": (ROOT / "tests/fixtures/hf/phi3", "{rank: 4}"),
    "mixtral-lora": (ROOT / "tests/fixtures/hf/mixtral", EXPERTS),
    "qwen3-moe-lora": (ROOT / "tests/fixtures/hf/qwen3_moe", EXPERTS),
}


def run(*command: str, cwd: Path) -> str:
    result = subprocess.run([str(c) for c in command], cwd=cwd, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(map(str, command))} failed:\n{result.stderr[-3000:]}")
    return result.stdout


def ours(run_dir: str, prompt: str, cwd: Path, chat: bool) -> list[int]:
    extra = ["--chat"] if chat else []
    out = run(BIN / "nnx-generate", run_dir, "--prompt", prompt, *extra, "--temperature", "0", "--max-tokens", "20",
              "--json", cwd=cwd)  # fmt: skip
    return json.loads(out)["tokens"][0]


def theirs(reference: str, model: Path, cwd: Path, prompts: list[str], chat: bool, adapter: Path | None = None):
    (cwd / "prompts.json").write_text(json.dumps(prompts))
    extra = ["--adapter", str(adapter)] if adapter else []
    run(reference, ROOT / "benchmarks/reference/transformers_logits.py", model, cwd / "ids.npy", cwd / "ref.npz",
        "--prompts", cwd / "prompts.json", *(["--chat"] if chat else []), *extra, cwd=cwd)  # fmt: skip
    out = np.load(cwd / "ref.npz")
    return out["logits"], [out[f"greedy_{i}"].tolist() for i in range(len(prompts))]


def our_logits(work: Path, ids: np.ndarray) -> np.ndarray:
    import jax

    from nnx_cli.lm import language_model, restore_parameters
    from nnx_cli.workdir import open_run

    r = open_run(work)
    exp = language_model(r, "")
    _, params = restore_parameters(r, exp, jax.devices()[0])
    return np.asarray(exp.moduledef.merge(params).logits(ids))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reference", required=True, help="python of a virtualenv with torch, transformers, peft")
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args()
    cwd = Path(tempfile.mkdtemp(prefix="nnx-roundtrip-"))
    np.save(cwd / "ids.npy", np.array([[5, 17, 33, 100, 200, 7, 9, 2, 11, 40]], np.int32))  # a batch for the logits
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in FACTS]
    (cwd / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows * 8))
    common = (
        "data: {source: chats.jsonl, format: chat, seq_len: 63, eval_split: null}\n"
        f"optimizer: {{name: adamw, learning_rate: 1.0e-2}}\ntrain: {{batch_size: 4, steps: {args.steps}}}\n"
    )
    for name, (directory, lora) in FINE_TUNES.items():
        adapters = f", lora: {lora}" if lora else ""
        (cwd / f"{name}.yaml").write_text(
            f"model: {{name: transformer_lm, pretrained: {directory}{adapters}}}\n" + common
        )
    questions = [q for q, _ in FACTS]
    failures, table = [], []
    for name, (directory, lora) in FINE_TUNES.items():
        run(BIN / "nnx-train", f"{name}.yaml", "--workdir", name, cwd=cwd)
        answers = [ours(name, q, cwd, chat=True) for q in questions]
        run(BIN / "nnx-export", name, "--out", f"{name}-merged", "--dtype", "float32", cwd=cwd)
        checks = [("transformers, merged", cwd / f"{name}-merged", None)]
        if lora and lora != EXPERTS:
            run(BIN / "nnx-export", name, "--out", f"{name}-adapter", "--adapter", cwd=cwd)
            checks.append(("peft, adapter on the base", directory, cwd / f"{name}-adapter"))
        reference_logits = our_logits(cwd / name, np.load(cwd / "ids.npy"))
        for label, model, adapter in checks:
            logits, greedy = theirs(args.reference, model, cwd, questions, chat=True, adapter=adapter)
            error = float(np.abs(reference_logits[..., : logits.shape[-1]] - logits).max() / np.abs(logits).max())
            same = sum(a == b for a, b in zip(answers, greedy))
            table.append((f"{name} fine-tune", label, f"{same}/{len(questions)}", f"{error:.1e}"))
            if same != len(questions) or error > 1e-4:
                failures.append(f"{name} / {label}")
    for name, options in (("llama", "num_kv_heads: 2, positions: rope, norm: rmsnorm, mlp: swiglu, bias: false"),
                          ("gpt2", "positions: learned")):  # fmt: skip
        (cwd / "text.txt").write_text(" ".join(a for _, a in FACTS) * 50)
        (cwd / f"{name}.yaml").write_text(
            f"model: {{name: transformer_lm, num_layers: 2, num_heads: 4, embed_dim: 64, dropout: 0.0, {options}}}\n"
            "data: {source: text.txt, text_key: text, seq_len: 64, eval_split: null}\n"
            f"train: {{batch_size: 8, steps: {args.steps}}}\n"
        )
        run(BIN / "nnx-train", f"{name}.yaml", "--workdir", name, cwd=cwd)
        run(BIN / "nnx-export", name, "--out", f"{name}-hf", cwd=cwd)
        mine = ours(name, "The old", cwd, chat=False)
        logits, greedy = theirs(args.reference, cwd / f"{name}-hf", cwd, ["The old"], chat=False)
        error = float(np.abs(our_logits(cwd / name, np.load(cwd / "ids.npy"))[..., : logits.shape[-1]] - logits).max()
                      / np.abs(logits).max())  # fmt: skip
        table.append((f"{name} from scratch", "transformers", f"{int(mine == greedy[0])}/1", f"{error:.1e}"))
        if mine != greedy[0] or error > 1e-4:
            failures.append(f"{name} from scratch")
    print(f"work dir: {cwd}\n")
    print("| run | loaded by | identical greedy answers | logits difference |\n| --- | --- | --- | --- |")
    for row in table:
        print("| " + " | ".join(row) + " |")
    print("\nall agree" if not failures else f"\ndisagreements: {', '.join(failures)}")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
