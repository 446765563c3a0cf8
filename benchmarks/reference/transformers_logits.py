"""The `transformers` / `peft` side of benchmarks/hf_roundtrip.py: logits and greedy tokens of a model directory.

    REFERENCE_PYTHON benchmarks/reference/transformers_logits.py MODEL_DIR IDS.npy OUT.npz [--adapter DIR]
        [--prompts PROMPTS.json [--chat]] [--max-tokens 20]

Loads MODEL_DIR in float32 (with the PEFT adapter DIR on top when given) and writes to OUT.npz the logits of
the int ids in IDS.npy ([batch, length]) and, for each prompt of PROMPTS.json (a JSON list of strings), the
ids `generate(do_sample=False)` returns after it as `greedy_<i>` (with --chat the prompt is a user turn of
the directory's chat template, as `nnx-generate --chat` renders it).
"""

import argparse
import json

import numpy as np
import torch
import transformers

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("ids")
parser.add_argument("out")
parser.add_argument("--adapter")
parser.add_argument("--prompts")
parser.add_argument("--chat", action="store_true")
parser.add_argument("--max-tokens", type=int, default=20)
args = parser.parse_args()

model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
if args.adapter:
    import peft

    model = peft.PeftModel.from_pretrained(model, args.adapter).eval()
out = {}
with torch.no_grad():
    out["logits"] = model(torch.tensor(np.load(args.ids)).long()).logits.float().numpy()
    if args.prompts:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        with open(args.prompts) as f:
            prompts = json.load(f)
        for i, prompt in enumerate(prompts):
            if args.chat:
                messages = [{"role": "user", "content": prompt}]
                text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
                ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
            else:
                ids = tokenizer(prompt, return_tensors="pt").input_ids
            generated = model.generate(ids, do_sample=False, max_new_tokens=args.max_tokens)
            out[f"greedy_{i}"] = generated[0, ids.shape[1] :].numpy()
np.savez(args.out, **out)
