"""Quantized weight formats as checkpoints store them, turned into what the engine's layers run."""
