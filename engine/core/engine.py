"""LLMEngine (add_request / step / abort); AsyncEngine (engine/core/async_engine.py) drives it from a thread."""

from __future__ import annotations

import logging
from itertools import count
from typing import NotRequired, TypedDict

import torch

from engine.attention import create_group_backends, resolve_backend
from engine.attention.kv_quant import resolve_kv_dtype
from engine.config import EngineConfig
from engine.core.cuda_graphs import graphs_off_because
from engine.core.device import resolve_device, resolve_dtype, size_thread_pool
from engine.core.distributed.ranks import RankSet, rank_config
from engine.core.images.intake import ImageIntake
from engine.core.kv.cache import PageAllocator, PagePool
from engine.core.kv.manager import KVCacheManager
from engine.core.kv.plan import plan_cache
from engine.core.kv.state_cache import StatePool, StateSlots
from engine.core.model_runner import ModelRunner
from engine.core.output.pooling import PoolingParams
from engine.core.output.processor import OutputProcessor
from engine.core.scheduling.grammar_wait import GrammarWait
from engine.core.scheduling.requests import Limits, PreparedRequest, build_group, check_request
from engine.core.scheduling.scheduler import Scheduler
from engine.core.scheduling.sequence import SequenceGroup
from engine.core.scheduling.step import ScheduledSeq
from engine.core.spec.build import accepted_counts, build_speculator, reads_final_hidden
from engine.core.spec.proposer import Target
from engine.cuda import linear_attention
from engine.cuda import setup as cuda_setup
from engine.errors import InvalidRequest, StartupError
from engine.inputs import ImageData
from engine.model.kv_spec import describe_groups
from engine.model.layers.lora import LoadedAdapter
from engine.model.loader import load_model
from engine.outputs import PoolingOutput, RequestOutput
from engine.sample.params import SamplingParams
from engine.sample.sampler import Sampler
from engine.sample.structured.compiler import GrammarCache
from engine.sample.structured.matcher import GrammarState
from engine.text.tokenizer import load_tokenizer
from engine.timing import timed

__all__ = ["EngineStats", "LLMEngine"]

log = logging.getLogger(__name__)


class EngineStats(TypedDict):
    """LLMEngine.stats(): the live load, read by /health and the worker's concurrency gauge."""

    kv_pages_free: int  # the first KV group's, cached prefix pages too
    preemptions: int
    tokens_run: int  # tokens fed to the model (prefix hits are not)
    requests_running: int
    requests_waiting: int  # queued, or waiting for their grammar to compile
    kv_pages_free_by_group: NotRequired[list[int]]  # a model of several KV groups
    # With a speculator: Speculator.stats()
    spec_proposed_tokens: NotRequired[int]
    spec_accepted_tokens: NotRequired[int]
    spec_verify_steps: NotRequired[int]
    spec_skipped_steps: NotRequired[int]
    spec_acceptance_rate: NotRequired[float]
    spec_mean_accepted_length: NotRequired[float]


class LLMEngine:
    """The synchronous engine: add requests, call step() until has_unfinished() is false."""

    def __init__(self, config: EngineConfig) -> None:
        self.start_ms: dict[str, int] = {}  # how long each start-up phase took, for the start-up log
        self.device = resolve_device(config.device)
        self.config = config = rank_config(config, self.device)  # tensor_parallel_size resolved, checked
        self.ranks: RankSet | None = None  # the other tensor-parallel ranks (None: this process runs the model)
        try:
            self._load_model(config)
            num_pages = self._build_cache(config)
            self._build_runner(config, num_pages)
            self._build_request_side(config)
        except BaseException:
            self.close()
            raise

    def _load_model(self, config: EngineConfig) -> None:
        """The other ranks (tensor parallelism), the weights, the tokenizer and the context length they allow."""
        self.dtype, self.dtype_reason = resolve_dtype(config.dtype, self.device, config.quantization)
        self.threads = size_thread_pool(config.cpu_threads) if self.device.type == "cpu" else None
        torch.manual_seed(config.seed)
        assert isinstance(config.tensor_parallel_size, int), "rank_config resolved 'auto' to a number"
        if config.tensor_parallel_size > 1:
            with timed(self.start_ms, "ranks"):
                self.ranks = RankSet(config, self.device)
        with timed(self.start_ms, "weights"):
            model, self.spec = load_model(
                config.model_path,
                self.dtype,
                self.device,
                config.quantization,
                config.lora,
                tp=self.ranks.tp if self.ranks is not None else None,
                max_model_len=config.max_model_len,
            )
        # Every family is an nn.Module implementing CausalLM (engine.model.models.model_class): the narrowing makes
        # self.model both, for the set-up that walks its modules and the runner that calls it.
        assert isinstance(model, torch.nn.Module), "model_class returns nn.Module subclasses"
        self.model = model
        self.lora = self.model.lora  # engine.model.layers.lora.LoraSet, or None
        self.adapters: dict[str, int] = self.lora.slots if self.lora is not None else {}
        with timed(self.start_ms, "tokenizer"):
            self.tokenizer = load_tokenizer(config.model_path)
        if not self.spec.eos_token_ids:  # as vLLM: the tokenizer's eos (a grammar with no stop token cannot end)
            self.spec.eos_token_ids.update({self.tokenizer.eos_token_id} - {None})
        self.max_model_len = min(
            config.max_model_len or self.spec.max_position_embeddings, self.spec.max_position_embeddings
        )
        if config.max_model_len and config.max_model_len > self.spec.max_position_embeddings:
            raise StartupError(
                f"max_model_len {config.max_model_len} is above the model's limit of "
                f"{self.spec.max_position_embeddings}",
                param="max_model_len",
            )
        if self.spec.encoder and self.max_model_len > config.max_num_batched_tokens:
            # NOTE: an encoder's prompt runs in one chunk (engine/model/models/bert.py): a longer one would never fit.
            raise StartupError(
                f"max_num_batched_tokens {config.max_num_batched_tokens} is below max_model_len {self.max_model_len}: "
                "an encoder runs each prompt in one step",
                param="max_num_batched_tokens",
            )

    def _build_cache(self, config: EngineConfig) -> list[int]:
        """The attention backends, the KV page pools (and a hybrid model's state pool) from the memory left, their
        manager and the scheduler; returns each KV group's number of pages."""
        groups = self.spec.kv_groups
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype)  # the pages': the model's, or FP8
        self.backend_name, self.backend_reason = resolve_backend(config.attention_backend, self.device, self.dtype)
        self.backends = create_group_backends(
            self.backend_name,
            groups,
            self.device,
            spec=self.spec,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,
            requested=config.attention_backend,
        )
        if self.device.type == "cuda" and self.ranks is None:  # a warm-up forward would need every rank
            with timed(self.start_ms, "warm-up"):
                for backend in self.backends:  # JIT builds now, not on a request
                    cuda_setup.warm_up(self.model, backend, config.page_size)
        plan = plan_cache(config, self.spec, self.model, self.device, self.dtype, self.kv_dtype, self.max_model_len)
        self.max_model_len = plan.max_model_len
        num_pages = plan.num_pages
        with timed(self.start_ms, "kv cache"):
            self.pools = [
                PagePool.for_group(g, n, config.page_size, self.kv_dtype, self.device)
                for g, n in zip(groups, num_pages, strict=True)
            ]
            recurrent = self.spec.recurrent
            self.state_pool: StatePool | None = None
            if recurrent is not None:
                assert plan.state_seqs is not None, "plan_cache sizes the state pool of a model with recurrent layers"
                self.state_pool = StatePool(recurrent, 2 * plan.state_seqs, self.dtype, self.device)
        if recurrent is not None:
            log.info("%s", linear_attention.describe(self.device, recurrent.kind))
        self.max_num_seqs = min(config.max_num_seqs, plan.state_seqs or config.max_num_seqs)
        state = None
        if recurrent is not None:
            assert plan.state_seqs is not None, "plan_cache sizes the state pool of a model with recurrent layers"
            state = StateSlots(plan.state_seqs, config.enable_prefix_caching)
        self.kv = KVCacheManager(
            specs=groups,
            num_pages=num_pages,
            page_size=config.page_size,
            enable_prefix_caching=config.enable_prefix_caching,
            state=state,
        )
        self.scheduler = Scheduler(
            kv=self.kv,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            policy=config.scheduling_policy,
            aging_steps=config.priority_aging_steps,
        )
        return num_pages

    def _build_runner(self, config: EngineConfig, num_pages: list[int]) -> None:
        """The model runner over the pools, the other ranks' pools sized as this one's, and (CUDA) its decode graphs."""
        peers = None
        if self.ranks is not None:  # the other ranks' pools, as many pages of their heads
            peers = self.ranks.share_cache(num_pages, self.state_pool.num_slots if self.state_pool else 0)
        self.runner = ModelRunner(
            model=self.model,
            groups=self.spec.kv_groups,
            pools=self.pools,
            backends=self.backends,
            sampler=Sampler(),
            device=self.device,
            recurrent=self.spec.recurrent,
            state_pool=self.state_pool,
            peers=peers,
            keep_hidden=reads_final_hidden(config.speculative),
        )
        if self.device.type == "cuda":
            head = config.speculative is not None and config.speculative.method in ("eagle3", "mtp")
            graphless = graphs_off_because(
                self.model,
                self.spec.kv_groups,
                self.device,
                self.spec.dtype,
                lora=self.lora is not None,
                head=head,
                ranks=self.ranks is not None,
            )
            with timed(self.start_ms, "graphs"):
                self.runner.capture_graphs(
                    max_num_seqs=config.max_num_seqs,
                    max_model_len=self.max_model_len,
                    enforce_eager=config.enforce_eager or graphless is not None,
                    why=graphless,
                )

    def _build_request_side(self, config: EngineConfig) -> None:
        """What a request meets before and after the runner: image intake, output processing, grammars, and the
        speculator (None unless config.speculative)."""
        self.images = ImageIntake(self.spec.vision, config.model_path, self.tokenizer, config.max_num_batched_tokens)
        self._seq_ids = count()
        self._arrivals = count()
        self.processor = OutputProcessor(self.tokenizer, self.max_model_len, lambda: next(self._seq_ids))
        self._groups: dict[str, SequenceGroup] = {}
        self._failures: list[tuple[str, Exception]] = []
        self.grammars = GrammarCache(
            tokenizer=self.tokenizer,
            vocab_size=self.spec.vocab_size,
            stop_token_ids=sorted(self.spec.eos_token_ids),
            threads=2 if self.device.type == "cpu" else 8,
            max_whitespace=config.structured_max_whitespace,
        )
        self._compiling = GrammarWait()
        self.speculator = build_speculator(
            config.speculative,
            Target(
                tokenizer=self.tokenizer,
                vocab_size=self.spec.vocab_size,
                recurrent=self.spec.recurrent is not None,
                dtype=self.dtype,
                device=self.device,
                kv_dtype=self.kv_dtype,
                backend_name=self.backend_name,
                page_size=config.page_size,
                num_pages=self.allocator.num_pages,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                model=self.model,
                model_path=config.model_path,
                max_num_seqs=self.max_num_seqs,
            ),
        )

    @property
    def pool(self) -> PagePool:  # the first KV group's (a full-attention model's only one)
        return self.pools[0]

    @property
    def allocator(self) -> PageAllocator:  # the first KV group's
        return self.kv.allocators[0]

    @property
    def limits(self) -> Limits:
        return Limits(
            vocab_size=self.spec.vocab_size,
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            adapters=self.adapters,
            hidden_size=self.spec.hidden_size,
            adapter_keys=self.lora.keys if self.lora is not None else {},
        )

    def prepare(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        images: list[ImageData] | None = None,
    ) -> PreparedRequest:
        """Checks a request once (InvalidRequest / ContextTooLong), decodes its images, submits its grammar."""
        prompt_token_ids, decoded = self.images.expand(prompt_token_ids, list(images or ()))  # before its length counts
        prompt = check_request(prompt_token_ids, params, self.limits)
        if images and not isinstance(params, SamplingParams):
            raise InvalidRequest("an embedding request takes no images", param="input")
        spans = self.images.spans(prompt, decoded)
        grammar = self.grammars.submit(params.structured) if params.structured is not None else None
        if grammar is not None and grammar.done():
            grammar.result()  # a constraint known to be bad fails here, before the request is in
        return PreparedRequest(prompt, params, grammar, spans)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        images: list[ImageData] | None = None,
    ) -> None:
        self.add(request_id, self.prepare(prompt_token_ids, params, images))

    def add(self, request_id: str, request: PreparedRequest) -> None:
        """Starts a prepared request (its grammar first, when it has one still compiling)."""
        if request_id in self._groups:
            raise InvalidRequest(f"request id {request_id!r} is already running", param="request_id")
        group = build_group(
            request_id,
            request,
            arrival=next(self._arrivals),
            next_seq_id=lambda: next(self._seq_ids),
            tokenizer=self.tokenizer,
            device=self.device,
            eos_token_ids=set(self.spec.eos_token_ids),
            limits=self.limits,
        )
        self._groups[request_id] = group
        if request.grammar is None:
            self.scheduler.add(group)
        elif request.grammar.done():
            self._start_grammar(group, request.grammar.result())
        else:
            self._compiling.add(request_id, group, request.grammar)

    def _start_grammar(self, group: SequenceGroup, compiled: object) -> None:
        """One matcher per choice (n, best_of) or for the first beam (beams fork theirs); then schedule."""
        for seq in group.seqs:
            seq.output_state.grammar = GrammarState.start(compiled)
        self.scheduler.add(group)

    def _admit_compiled(self) -> None:
        """Requests whose grammar finished compiling join the scheduler, or fail alone if it did not compile."""
        for group, future in self._compiling.finished(idle=not self.scheduler.has_work()):
            try:
                compiled = future.result()
            except Exception as exc:
                self._fail(group, exc)
                continue
            self._start_grammar(group, compiled)

    def abort(self, request_id: str) -> RequestOutput | None:
        """Frees the request's pages now; returns its last output (finish_reason "abort"), None if unknown."""
        if (group := self._groups.pop(request_id, None)) is None:
            return None
        self._compiling.drop(request_id)
        self.scheduler.remove(group)
        if self.speculator is not None:
            self.speculator.settle(self.scheduler.running)
        return self.processor.abort(group)

    def install_adapter(self, name: str, adapter: LoadedAdapter) -> None:
        """Serves an adapter read while serving (LoraSet.read) under `name`, in a slot no running request reads."""
        slot = self.lora.install(name, adapter, {g.adapter for g in self._groups.values() if g.adapter is not None})
        if self.ranks is not None:  # every other rank reads its part of it into the same slot
            self.ranks.install_adapter(slot, name, adapter.folder)

    def remove_adapter(self, name: str) -> None:
        """Stops serving the adapter; requests running with it finish with it, and then its slot is free."""
        self.lora.remove(name)

    def has_unfinished(self) -> bool:
        return bool(self._groups)

    def abort_all(self) -> list[str]:
        """Drops every request (after a failure outside any one of them); returns their ids."""
        for request_id in (ids := list(self._groups)):
            self.abort(request_id)
        return ids

    def pop_failures(self) -> list[tuple[str, Exception]]:
        """Requests that failed since the last call (they are gone from the engine), with their errors."""
        failures = self._failures
        self._failures = []
        return failures

    def _fail(self, group: SequenceGroup, exc: Exception) -> None:
        log.error("request %s failed: %r", group.request_id, exc)
        if self._groups.pop(group.request_id, None) is not None:
            self._compiling.drop(group.request_id)
            self.scheduler.remove(group)
            self._failures.append((group.request_id, exc))

    def close(self) -> None:
        """Ends the other tensor-parallel ranks (nothing to do on one rank); the engine runs no more steps."""
        if self.ranks is not None:
            self.ranks.close()

    # ---- the step
    def step(self) -> list[RequestOutput | PoolingOutput]:
        self._admit_compiled()
        proposals = self.speculator.propose(self.scheduler.running) if self.speculator is not None else None
        out = self.scheduler.schedule(proposals)
        for group, exc in out.failed:
            self._fail(group, exc)
        if not out.scheduled:
            return []
        by_group: dict[int, tuple[SequenceGroup, list[tuple[int, ScheduledSeq]]]] = {}
        for index, item in enumerate(out.scheduled):
            by_group.setdefault(id(item.group), (item.group, []))[1].append((index, item))
        try:
            result = self.runner.execute(out)
        except Exception as exc:  # the batch as a whole failed: so do its requests, the engine goes on
            if self.ranks is not None:  # ... unless the ranks may now be out of step: then it ends
                raise self.ranks.fail(exc) from exc
            for group, _ in by_group.values():
                self._fail(group, exc)
            return []
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
        # NOTE: after the tokens are appended (a speculating sequence keeps the KV of those it accepted), and the
        # pages settle before any group leaves: a choice may fork and finish within this step.
        self.scheduler.commit(out)
        self.runner.settle(out)
        if self.speculator is not None:
            self.speculator.record(*accepted_counts(out, result))
            self.speculator.observe(out, result)
        self.scheduler.postprocess(*self.processor.take_page_changes())
        for group in done:
            self._groups.pop(group.request_id, None)
            self.scheduler.remove(group)
        for group, error in failed:
            self._fail(group, error)
        if self.speculator is not None:
            self.speculator.settle(self.scheduler.running)
        return outputs

    def stats(self) -> EngineStats:
        """The live load: free KV pages (cached prefix ones too), preemptions, tokens run, requests in and waiting,
        and the speculator's acceptance counts."""
        stats = EngineStats(
            kv_pages_free=self.allocator.num_free,
            preemptions=self.scheduler.num_preemptions,
            tokens_run=self.runner.num_tokens_run,
            requests_running=len(self.scheduler.running),
            requests_waiting=len(self.scheduler.waiting) + len(self._compiling),
        )
        if len(self.pools) > 1:
            stats["kv_pages_free_by_group"] = self.kv.num_free
        if self.speculator is not None:
            stats.update(self.speculator.stats())
        return stats

    def describe(self) -> dict[str, object]:
        """What the engine runs (model, backend, dtype, KV cache, limits), for the start-up line and /health."""
        return {
            "model": self.config.model_path,
            "architecture": self.spec.architecture,
            "backend": self.backend_name,
            "backend_reason": self.backend_reason,
            "dtype": str(self.dtype).removeprefix("torch."),
            "dtype_reason": self.dtype_reason,
            "quantization": self.config.quantization,
            "device": str(self.device),
            "tensor_parallel_size": self.config.tensor_parallel_size,
            "threads": self.threads,
            "max_model_len": self.max_model_len,
            "kv_pages": self.allocator.num_pages,
            "kv_groups": describe_groups(self.spec.kv_groups),
            "kv_pages_by_group": [allocator.num_pages for allocator in self.kv.allocators],
            "page_size": self.pool.page_size,
            "kv_bytes": sum(pool.nbytes for pool in self.pools),
            "kv_dtype": str(self.kv_dtype).removeprefix("torch."),
            "max_num_seqs": self.max_num_seqs,
            # A hybrid model's recurrent-state pool: the sequences it holds (as many snapshot slots again), bytes.
            "state_seqs": self.kv.state.num_seqs if self.kv.state is not None else None,
            "state_bytes": self.state_pool.nbytes if self.state_pool is not None else 0,
            "max_num_batched_tokens": self.config.max_num_batched_tokens,
            "prefix_caching": self.config.enable_prefix_caching,
            "adapters": list(self.adapters),
            "speculative": self.speculator.describe() if self.speculator is not None else None,
        }
