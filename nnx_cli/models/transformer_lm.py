"""`transformer_lm`, as earlier releases imported it: the model now lives in :mod:`nnx_cli.models.transformer`.

from nnx_cli.models.transformer_lm import TransformerLM   # still works; new code imports nnx_cli.models.transformer
"""

from nnx_cli.models.transformer import (
    MASKED_LOGIT,
    MLP,
    PROJECTIONS,
    VOCAB_MULTIPLE,
    Architecture,
    Attention,
    Block,
    Dense,
    Lora,
    RMSNorm,
    TransformerLM,
    architecture,
    lora_options,
    padded_vocab_size,
    rope_frequencies,
    rotate,
)

__all__ = [
    "MASKED_LOGIT",
    "MLP",
    "PROJECTIONS",
    "VOCAB_MULTIPLE",
    "Architecture",
    "Attention",
    "Block",
    "Dense",
    "Lora",
    "RMSNorm",
    "TransformerLM",
    "architecture",
    "lora_options",
    "padded_vocab_size",
    "rope_frequencies",
    "rotate",
]
