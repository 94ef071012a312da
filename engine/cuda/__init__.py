"""CUDA: start-up (backend warm-up, KV budget), decode CUDA graphs and FlashInfer's fused kernels."""
