"""The engine's core: the step loop and what it drives.

| file or package     | holds                                                                                  |
|---------------------|----------------------------------------------------------------------------------------|
| engine.py           | LLMEngine: add_request, step, abort; builds every collaborator at start-up             |
| async_engine.py     | AsyncEngine: the engine on its own thread, asyncio callers streaming its outputs       |
| request_clock.py    | a generation request timed as its outputs reach the caller, for an observer (metrics)  |
| llm.py              | LLM: offline batch generation, as vLLM's LLM(...).generate                             |
| model_runner.py     | one scheduled step through the model: inputs, page table, forward, logits, sampling    |
| cuda_graphs.py      | decode steps replayed from CUDA graphs                                                 |
| device.py           | the device, the serving dtype and torch's CPU threads                                  |
| kernel_plan.py      | the FlashInfer modules a model needs (the image build precompiles them)                |
| scheduling/         | requests in, sequences, the scheduler's plan for each step                             |
| kv/                 | the paged KV cache, its manager, its sizing and the recurrent state slots              |
| output/             | after a step: tokens appended, choices forked, stops, pooled embeddings, outputs built |
| images/             | a request's images matched to the prompt, and the positions images give tokens         |
| spec/               | speculative decoding: proposers and the verification of their guesses                 |
| distributed/        | tensor-parallel ranks: started and fed by rank 0                                       |
"""
