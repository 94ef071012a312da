"""LLMEngine (add_request / step / abort); AsyncEngine (engine/async_engine.py) drives it from a thread."""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from itertools import count

import torch

from engine import cuda_setup
from engine.attention import create_backend
from engine.beam_search import BeamSearch
from engine.config import EngineConfig
from engine.cpu_threads import size_thread_pool
from engine.detokenizer import Detokenizer
from engine.errors import ContextTooLong, InvalidRequest
from engine.kv_cache import PageAllocator, PagePool, adapter_salt
from engine.loader import load_model
from engine.logits_processor import tokenize_bad_words
from engine.model_runner import ModelRunner
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput
from engine.sampler import Sampler
from engine.sampling import SamplingParams
from engine.scheduler import ScheduledSeq, Scheduler
from engine.sequence import Sequence, SequenceGroup
from engine.structured.compiler import GrammarCache
from engine.structured.matcher import GrammarState
from engine.timing import timed
from engine.tokenizer import load_tokenizer

__all__ = ["LLMEngine"]

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# CPU default pool: room for max_num_seqs requests of this many tokens, but at most CPU_KV_BYTES.
CPU_CONTEXT_PER_SEQ = 2048
CPU_KV_BYTES = 1 << 30
# How long an idle step waits for a grammar compile before it returns (and the caller's loop looks again).
COMPILE_POLL_S = 0.02


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device, quantization: str | None = None) -> tuple[torch.dtype, str]:
    """The serving dtype and why it was picked. auto: bfloat16 on CUDA, on CPUs with bfloat16 instructions
    (AVX512-BF16 or AMX: 1.7 to 3 times float32's speed there, bench/RESULTS.md) and with int4 weights
    (torch's int4 kernel is vectorised for bfloat16 only); float32 on other CPUs, where bfloat16 is emulated."""
    if name != "auto":
        if name not in DTYPES:
            raise InvalidRequest(f"unknown dtype {name!r} (auto, {', '.join(DTYPES)})", param="dtype")
        return DTYPES[name], "DTYPE"
    if device.type == "cuda":
        return torch.bfloat16, "auto: CUDA"
    if quantization == "int4":
        return torch.bfloat16, "auto: int4 weights"
    if torch.cpu._is_amx_tile_supported():
        return torch.bfloat16, "auto: the CPU has AMX"
    if torch.cpu._is_avx512_bf16_supported():
        return torch.bfloat16, "auto: the CPU has AVX512-BF16"
    return torch.float32, "auto: the CPU has no bfloat16 instructions"


class LLMEngine:
    """The synchronous engine: add requests, call step() until has_unfinished() is false."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.start_ms: dict[str, int] = {}  # how long each start-up phase took, for the start-up log
        self.device = resolve_device(config.device)
        self.dtype, self.dtype_reason = resolve_dtype(config.dtype, self.device, config.quantization)
        self.threads = size_thread_pool() if self.device.type == "cpu" else None
        torch.manual_seed(config.seed)
        with timed(self.start_ms, "weights"):
            self.model, self.spec = load_model(config.model_path, self.dtype, self.device, config.quantization,
                                               config.lora)
        self.adapters: dict[str, int] = self.model.lora.slots if self.model.lora is not None else {}
        with timed(self.start_ms, "tokenizer"):
            self.tokenizer = load_tokenizer(config.model_path)
        self.max_model_len = min(config.max_model_len or self.spec.max_position_embeddings,
                                 self.spec.max_position_embeddings)
        if config.max_model_len and config.max_model_len > self.spec.max_position_embeddings:
            raise InvalidRequest(f"max_model_len {config.max_model_len} is above the model's limit of "
                                 f"{self.spec.max_position_embeddings}", param="max_model_len")
        s = self.spec
        backend = cuda_setup.attention_backend_name(config.attention_backend, self.device, self.dtype)
        self.backend = create_backend(backend, self.device, **cuda_setup.backend_kwargs(s, self.dtype))
        if self.device.type == "cuda":
            with timed(self.start_ms, "warm-up"):
                cuda_setup.warm_up(self.model, self.backend, config.page_size)  # JIT builds now, not on a request
        num_pages = self._num_pages(PagePool.bytes_per_page(s.num_layers, config.page_size, s.num_kv_heads,
                                                            s.head_dim, self.dtype))
        with timed(self.start_ms, "kv cache"):
            self.pool = PagePool(s.num_layers, num_pages, config.page_size, s.num_kv_heads, s.head_dim,
                                 self.dtype, self.device)
        self.allocator = PageAllocator(num_pages, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.allocator, config.page_size, config.max_num_seqs,
                                   config.max_num_batched_tokens)
        self.runner = ModelRunner(self.model, self.pool, self.backend, Sampler(), self.device)
        if self.device.type == "cuda":
            with timed(self.start_ms, "graphs"):
                self.runner.graph_runner = cuda_setup.prepare_cuda(
                    self.model, self.backend, self.pool.kv_caches, page_size=config.page_size,
                    max_num_seqs=config.max_num_seqs, max_model_len=self.max_model_len,
                    # NOTE: a step's adapter grouping is Python control flow that a replayed graph would freeze.
                    enforce_eager=config.enforce_eager or bool(self.adapters))
        self._seq_ids = count()
        self._arrivals = count()
        self.processor = OutputProcessor(self.tokenizer, self.max_model_len,
                                         lambda: next(self._seq_ids))
        self._groups: dict[str, SequenceGroup] = {}
        self._failures: list[tuple[str, Exception]] = []
        # Grammars are compiled off the engine loop; a request waits here, outside the scheduler, until its
        # grammar is ready, while the others go on decoding.
        self.grammars = GrammarCache(self.tokenizer, self.spec.vocab_size, sorted(self.spec.eos_token_ids),
                                     threads=2 if self.device.type == "cpu" else 8)
        self._compiling: dict[str, tuple[SequenceGroup, Future]] = {}

    def _num_pages(self, page_bytes: int) -> int:
        c, ps = self.config, self.config.page_size
        full_seq = -(-self.max_model_len // ps)
        if c.num_kv_pages:
            pages = c.num_kv_pages
        elif c.kv_cache_bytes:
            pages = c.kv_cache_bytes // page_bytes
        elif self.device.type == "cuda":
            reserve = cuda_setup.reserve_bytes(
                self.model.args, self.dtype, max_num_batched_tokens=c.max_num_batched_tokens,
                max_num_seqs=c.max_num_seqs, max_pages_per_seq=full_seq, graphs=not c.enforce_eager)
            pages = cuda_setup.kv_budget_bytes(self.device, c.gpu_memory_utilization, reserve) // page_bytes
        else:
            want = c.max_num_seqs * min(self.max_model_len, CPU_CONTEXT_PER_SEQ)
            pages = max(full_seq, min(-(-want // ps), CPU_KV_BYTES // page_bytes))
        if pages < full_seq:
            if c.max_model_len:
                raise InvalidRequest(f"the KV cache ({pages} pages of {ps} tokens) cannot hold one sequence of "
                                     f"max_model_len={self.max_model_len} tokens", param="max_model_len")
            log.warning("max_model_len lowered to %d tokens to fit the KV cache", pages * ps)
            self.max_model_len = pages * ps
        return pages

    # ---- requests
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> list[int]:
        """The prompt as it will run (after truncate_prompt_tokens); raises InvalidRequest / ContextTooLong."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequest("params must be SamplingParams", param="sampling_params")
        if params.adapter is not None and params.adapter not in self.adapters:
            raise InvalidRequest(f"unknown LoRA adapter {params.adapter!r}", param="model")
        prompt = list(prompt_token_ids)
        if params.truncate_prompt_tokens:
            prompt = prompt[-params.truncate_prompt_tokens :]
        if not prompt:
            raise InvalidRequest("the prompt is empty", param="prompt")
        vocab = self.spec.vocab_size
        if any(not isinstance(t, int) or t < 0 or t >= vocab for t in prompt):
            raise InvalidRequest(f"the prompt has token ids outside the vocabulary (size {vocab})", param="prompt")
        params.check_vocab(vocab)
        limit = self.max_model_len
        if len(prompt) >= limit:
            raise ContextTooLong(f"This model's maximum context length is {limit} tokens. However, your prompt "
                                 f"has {len(prompt)} tokens, leaving no room for the completion.", param="prompt")
        if params.max_tokens is not None and len(prompt) + params.max_tokens > limit:
            raise ContextTooLong(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(prompt) + params.max_tokens} tokens ({len(prompt)} in the prompt, {params.max_tokens} in "
                "the completion). Please reduce the length of the prompt or the completion.", param="max_tokens")
        width = params.num_sequences
        if width > min(self.config.max_num_seqs, self.config.max_num_batched_tokens):
            raise InvalidRequest(f"{width} sequences per request exceed this engine's max_num_seqs "
                                 f"({self.config.max_num_seqs})", param="best_of" if params.best_of else "n")
        return prompt

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self._groups:
            raise InvalidRequest(f"request id {request_id!r} is already running", param="request_id")
        prompt = self.validate(prompt_token_ids, params)
        eos = set(self.spec.eos_token_ids)
        salt = adapter_salt(params.adapter)
        beam = None
        if params.use_beam_search:
            stops = (set() if params.ignore_eos else eos) | set(params.stop_token_ids or ())
            max_tokens = min(params.max_tokens or self.max_model_len, self.max_model_len - len(prompt))
            beam = BeamSearch(params.num_sequences, length_penalty=params.length_penalty,
                              early_stopping=params.early_stopping, stop_token_ids=stops, max_tokens=max_tokens)
            seqs = [Sequence(next(self._seq_ids), list(prompt), len(prompt), cache_salt=salt)]
        else:
            seqs = [
                Sequence(next(self._seq_ids), list(prompt), len(prompt), index=i,
                         generator=self._generator(params.seed, i), detokenizer=self._detokenizer(params, prompt),
                         cache_salt=salt, stop_reader=params.stop_reader() if params.stop_reader else None)
                for i in range(params.num_sequences)
            ]
        compiling = self.grammars.submit(params.structured) if params.structured is not None else None
        if compiling is not None and compiling.done():
            compiling.result()  # a constraint known to be bad fails here, before the request is in
        bad_words = tokenize_bad_words(self.tokenizer, params.bad_words) if params.bad_words else []
        group = SequenceGroup(request_id, prompt, params, seqs, next(self._arrivals), eos_token_ids=eos,
                              bad_words_ids=bad_words, beam=beam, adapter=self.adapters.get(params.adapter))
        self._groups[request_id] = group
        if compiling is None:
            self.scheduler.add(group)
        elif compiling.done():
            self._start_grammar(group, compiling.result())
        else:
            self._compiling[request_id] = (group, compiling)

    def _start_grammar(self, group: SequenceGroup, compiled: object) -> None:
        """One matcher per choice (n, best_of) or for the first beam (beams fork theirs); then schedule."""
        for seq in group.seqs:
            seq.grammar = GrammarState.start(compiled)
        self.scheduler.add(group)

    def _admit_compiled(self) -> None:
        """Requests whose grammar finished compiling join the scheduler, or fail alone if it did not compile."""
        if not self._compiling:
            return
        if not self.scheduler.has_work():
            # Nothing else to run: wait a little for a compile instead of spinning.
            wait_futures([f for _, f in self._compiling.values()], timeout=COMPILE_POLL_S,
                         return_when=FIRST_COMPLETED)
        for request_id, (group, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[request_id]
            try:
                compiled = future.result()
            except Exception as exc:
                self._fail(group, exc)
                continue
            self._start_grammar(group, compiled)

    def _generator(self, seed: int | None, index: int) -> torch.Generator | None:
        if seed is None:
            return None
        # Choice i of a seeded request draws from its own stream, fixed by (seed, i) alone.
        return torch.Generator(device=self.device).manual_seed((seed + index * 0x9E3779B97F4A7C15) % 2**64)

    def _detokenizer(self, params: SamplingParams, prompt: list[int]) -> Detokenizer:
        return Detokenizer(
            self.tokenizer, skip_special_tokens=params.skip_special_tokens,
            spaces_between_special_tokens=params.spaces_between_special_tokens, stop=params.stop,
            include_stop_str_in_output=params.include_stop_str_in_output, prompt_token_ids=prompt,
        )

    def abort(self, request_id: str) -> RequestOutput | None:
        """Frees the request's pages now; returns its last output (finish_reason "abort"), None if unknown."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return None
        self._compiling.pop(request_id, None)
        self.scheduler.remove(group)
        return self.processor.abort(group)

    def has_unfinished(self) -> bool:
        return bool(self._groups)

    def abort_all(self) -> list[str]:
        """Drops every request (after a failure outside any one of them); returns their ids."""
        ids = list(self._groups)
        for request_id in ids:
            self.abort(request_id)
        return ids

    def pop_failures(self) -> list[tuple[str, Exception]]:
        """Requests that failed since the last call (they are gone from the engine), with their errors."""
        failures, self._failures = self._failures, []
        return failures

    def _fail(self, group: SequenceGroup, exc: Exception) -> None:
        log.error("request %s failed: %r", group.request_id, exc)
        if self._groups.pop(group.request_id, None) is not None:
            self._compiling.pop(group.request_id, None)
            self.scheduler.remove(group)
            self._failures.append((group.request_id, exc))

    # ---- the step
    def step(self) -> list[RequestOutput]:
        self._admit_compiled()
        out = self.scheduler.schedule()
        for group, exc in out.failed:
            self._fail(group, exc)
        if not out.scheduled:
            return []
        by_group: dict[int, tuple[SequenceGroup, list[tuple[int, ScheduledSeq]]]] = {}
        for i, s in enumerate(out.scheduled):
            by_group.setdefault(id(s.group), (s.group, []))[1].append((i, s))
        try:
            result = self.runner.execute(out)
        except Exception as exc:  # the batch as a whole failed: so do its requests, the engine goes on
            for group, _ in by_group.values():
                self._fail(group, exc)
            return []
        self.scheduler.commit(out)
        outputs, done, failed = [], [], []
        for group, items in by_group.values():
            try:
                output = self.processor.process(group, items, result)
            except Exception as exc:
                failed.append((group, exc))
                continue
            if group.finished:
                done.append(group)
            if output is not None:
                outputs.append(output)
        # NOTE: the pages settle before any group leaves: a choice may fork and finish within this step.
        self.scheduler.postprocess(*self.processor.take_page_changes())
        for group in done:
            self._groups.pop(group.request_id, None)
            self.scheduler.remove(group)
        for group, exc in failed:
            self._fail(group, exc)
        return outputs

    def describe(self) -> dict:
        return {
            "model": self.config.model_path,
            "architecture": self.spec.architecture,
            "backend": type(self.backend).__name__,
            "dtype": str(self.dtype).removeprefix("torch."),
            "dtype_reason": self.dtype_reason,
            "quantization": self.config.quantization,
            "device": str(self.device),
            "threads": self.threads,
            "max_model_len": self.max_model_len,
            "kv_pages": self.pool.num_pages,
            "page_size": self.pool.page_size,
            "kv_bytes": self.pool.nbytes,
            "max_num_seqs": self.config.max_num_seqs,
            "max_num_batched_tokens": self.config.max_num_batched_tokens,
            "prefix_caching": self.config.enable_prefix_caching,
            "adapters": list(self.adapters),
        }
