"""Quantized checkpoints: one linear method per format, chosen from the quantization_config of config.json."""
