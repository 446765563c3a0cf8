"""`transformer_lm`: a decoder-only Transformer language model, with a key-value cache for decoding.

One model for the families people train today: GPT-2 (learned positions,
LayerNorm, biases, a tanh-GELU MLP) and the Llama family (Llama 2/3, Mistral,
Qwen2/3, SmolLM: rotary positions, RMSNorm, no biases, a SwiGLU MLP,
grouped-query attention) differ by a few switches (spec hf.md, "Architectures"),
and Gemma 2/3 and Phi-3 by a few more (sliding windows per layer, soft-capped
logits, norms of `1 + w` before and after each half, GeGLU, scaled
embeddings, partial rotary embeddings)::

    model = TransformerLM((256,), 257, num_layers=6, num_heads=6, embed_dim=384, ctx=nnx.context(0))   # GPT
    llama = TransformerLM((256,), 32000, num_layers=4, num_heads=8, num_kv_heads=2, embed_dim=512,
                          positions="rope", norm="rmsnorm", mlp="swiglu", bias=False, ctx=nnx.context(0))
    batch = {"tokens": jnp.zeros((8, 257), jnp.int32)}    # windows of seq_len + 1 tokens
    metrics = model.metrics(batch, nnx.context(dropout=0, flags={"deterministic": False}))
    metrics["loss"].shape                                 # (8,): mean nats per token of each window

Pre-norm blocks: `h + attention(norm(h))`, then `h + mlp(norm(h))`. The
rotary convention is Hugging Face Llama's (the two halves of each head turn
together), so imported weights need no permutation. The vocabulary is
padded to a multiple of 128 (257 -> 384) for sharding and alignment; the
padded ids get a large negative logit (in float32) wherever logits come out,
so the loss, accuracy and sampling never pick them.

Decoding: `init_cache(batch_size, max_len)` adds `nnx.Cache` keys and values
(`num_kv_heads` of them per layer) to every attention layer (stacked along
`layers` when scanned), `prefill` runs a prompt through and fills them,
`decode` takes one token per row at per-row positions. `nnx_cli.decoding`
drives these from jitted pure functions.

One module per part, each building its layers from the checked options
(:class:`Architecture`); the imports run one way, down this list:

- :mod:`.model`: `TransformerLM` (embeddings, the stack of blocks, logits,
  metrics, decoding entry points) and the vocabulary padding;
- :mod:`.loss`: the head and the cross-entropy in chunks of positions, so
  that a training step never holds the `[B, T, vocab]` logits;
- :mod:`.block`: `Block`, the pre-norm residual layout (and post norms) and
  rematerialisation;
- :mod:`.attention`: `Attention`, its masks (`visible`: causal, windowed,
  per segment), soft-capping, key-value cache (rings for sliding layers), what
  differs per layer, the choice of fused kernel; :mod:`.mlp`: `MLP` (GELU,
  SwiGLU, GeGLU);
- :mod:`.norms`: `RMSNorm` (and Gemma's `1 + w`) and `LayerNorm`, each with its own backward pass;
  :mod:`.rotary`: rotary positions, partial rotation and their scalings;
  :mod:`.dense`: `Dense` and the logical-axis helpers;
- :mod:`.options`: `Architecture`, :func:`architecture` (every option check),
  LoRA's options and projection names.

A model family maps its `config.json` onto these options in
:mod:`nnx_cli.hf.families`; the model itself knows no family.
"""

from nnx_cli.models.transformer.attention import MASKED_LOGIT, Attention
from nnx_cli.models.transformer.block import Block
from nnx_cli.models.transformer.dense import Dense
from nnx_cli.models.transformer.mlp import MLP
from nnx_cli.models.transformer.model import VOCAB_MULTIPLE, TransformerLM, padded_vocab_size
from nnx_cli.models.transformer.norms import LayerNorm, RMSNorm
from nnx_cli.models.transformer.options import PROJECTIONS, Architecture, Lora, architecture, lora_options
from nnx_cli.models.transformer.rotary import rope_frequencies, rotate

__all__ = [
    "MASKED_LOGIT",
    "MLP",
    "PROJECTIONS",
    "VOCAB_MULTIPLE",
    "Architecture",
    "Attention",
    "Block",
    "Dense",
    "LayerNorm",
    "Lora",
    "RMSNorm",
    "TransformerLM",
    "architecture",
    "lora_options",
    "padded_vocab_size",
    "rope_frequencies",
    "rotate",
]
