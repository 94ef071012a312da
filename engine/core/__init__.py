"""The engine's core: LLMEngine and its asyncio bridge, the scheduler, the paged KV cache, sequences, the model
runner and output processing."""
