"""The `transformers` / `peft` side of benchmarks/hf_roundtrip.py: logits and greedy tokens of a model directory.

    REFERENCE_PYTHON benchmarks/reference/transformers_logits.py MODEL_DIR IDS.npy OUT.npz [--adapter DIR]
    [--prompt TEXT --chat]

Loads MODEL_DIR in float32 (with the PEFT adapter DIR on top when given), and writes the logits of the int
ids in IDS.npy ([batch, length]) to OUT.npz; with --prompt also the ids of greedy `generate` (20 new tokens;
--chat applies the directory's chat template to the prompt as a user turn).
"""

import argparse

import numpy as np
import torch
import transformers

parser = argparse.ArgumentParser()
parser.add_argument("model")
parser.add_argument("ids")
parser.add_argument("out")
parser.add_argument("--adapter")
parser.add_argument("--prompt")
parser.add_argument("--chat", action="store_true")
args = parser.parse_args()

model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
if args.adapter:
    import peft

    model = peft.PeftModel.from_pretrained(model, args.adapter).eval()
ids = torch.tensor(np.load(args.ids)).long()
out = {}
with torch.no_grad():
    out["logits"] = model(ids).logits.float().numpy()
    if args.prompt is not None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(args.model)
        if args.chat:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": args.prompt}], tokenize=False, add_generation_prompt=True
            )
            prompt = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        else:
            prompt = tokenizer(args.prompt, return_tensors="pt").input_ids
        generated = model.generate(prompt, do_sample=False, max_new_tokens=20)
        out["greedy"] = generated[0, prompt.shape[1] :].numpy()
np.savez(args.out, **out)
