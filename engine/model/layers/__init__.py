"""Building blocks of the decoders: norm, rotary embedding, linear layers (packed, int4), activation, LoRA."""
