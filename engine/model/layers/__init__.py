"""Building blocks of the decoders: norm, rotary embedding, linear layers (packed, int4), activation, LoRA,
mixture of experts (moe.py: the experts; routing.py: how tokens pick them), Gated DeltaNet."""
