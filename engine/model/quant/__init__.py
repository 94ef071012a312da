"""Quantized checkpoints: one linear method per format, chosen from the quantization_config of config.json, and
the block formats some families store (MXFP4), each with its exact dequantisation."""
