"""AsyncEngine: one background thread drives LLMEngine.step(); asyncio callers stream RequestOutputs."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.core.engine import EngineStats, LLMEngine
from engine.core.output.pooling import PoolingParams
from engine.core.request_clock import RequestClock
from engine.core.scheduling.requests import PreparedRequest
from engine.errors import InvalidRequest, RankFailed
from engine.inputs import ImageData, ImagePrompt
from engine.outputs import PoolingOutput, RequestObserver, RequestOutput
from engine.sample.params import SamplingParams

log = logging.getLogger(__name__)


# The commands the engine's thread takes from its inbox, between two steps.
@dataclass
class AddRequest:
    """Start a prepared request (unless its stream closed before it started)."""

    request_id: str
    request: PreparedRequest


@dataclass
class CallOnLoop:
    """Run call(*args) on the engine's thread and settle `done` with its result (adapter loads and unloads)."""

    call: Callable[..., Any]
    args: tuple[Any, ...]
    done: Future


@dataclass
class Abort:
    """End the request and free its pages; its stream gets the last "abort" output."""

    request_id: str


@dataclass
class Fatal:
    """A tensor-parallel rank died while the loop slept: the engine cannot run any more."""

    error: RankFailed


Command = AddRequest | CallOnLoop | Abort | Fatal


class AsyncEngine:
    """LLMEngine behind one background thread; asyncio callers stream RequestOutputs from generate()."""

    def __init__(
        self,
        config: EngineConfig,
        on_fatal: Callable[[RankFailed], None] | None = None,
        observer: RequestObserver | None = None,
    ) -> None:
        """on_fatal: called (on the engine's thread) once the engine has died, after its requests got the error.
        observer: told each generation request's timing and token counts (the worker's metrics)."""
        self._on_fatal = on_fatal
        self._observer = observer
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._refusal: BaseException | None = None  # set by fail_all: the error new requests get
        started: Future[LLMEngine] = Future()
        self._thread = threading.Thread(target=self._run, args=(config, started), name="engine-loop", daemon=True)
        self._thread.start()
        self.engine: LLMEngine = started.result()  # the engine's start-up error, if any, is raised here

    def _run(self, config: EngineConfig, started: Future) -> None:
        """Builds the engine on this thread, then serves.

        NOTE: torch runs its CPU kernels on an OpenMP team belonging to the thread that calls them, and its
        thread count is a per-thread setting. Loading the weights on the caller's thread left a second team
        behind, and two teams on two cores made every decode step about a third slower (bench/RESULTS.md).
        """
        try:
            self.engine = LLMEngine(config)
        except BaseException as exc:
            started.set_exception(exc)
            return
        # A rank that dies while the loop sleeps wakes it with the failure.
        if self.engine.ranks is not None:
            self.engine.ranks.on_failure = lambda exc: self._post(Fatal(exc))
        started.set_result(self.engine)
        self._loop()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def image_prompt(self) -> ImagePrompt | None:
        """How this model's prompt shows an image (None: it takes no image input)."""
        return self.engine.images.prompt

    async def prompt_length(self, prompt_token_ids: list[int], images: list[ImageData]) -> int:
        """The prompt's length once each image placeholder is widened as generate() widens it; nothing runs."""
        return len(await self.widened_prompt(prompt_token_ids, images))

    async def widened_prompt(self, prompt_token_ids: list[int], images: list[ImageData]) -> list[int]:
        """The prompt's token ids with each image placeholder widened as generate() widens it; nothing runs."""
        return (await asyncio.to_thread(self.engine.images.expand, prompt_token_ids, images))[0]

    def describe(self) -> dict:
        return self.engine.describe()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    @property
    def start_ms(self) -> dict[str, int]:
        """How long each start-up phase took (weights, tokenizer, kv cache, ...)."""
        return self.engine.start_ms

    @property
    def pooling(self):  # engine.model.pooling.PoolingConfig
        """How this model pools an embedding (method, normalisation, whether it shortens)."""
        return self.engine.spec.pooling

    async def embed(
        self,
        prompt_token_ids: list[int],
        request_id: str,
        *,
        dimensions: int | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> PoolingOutput:
        """One embedding request, run in the same batches as generation; raises its error instead."""
        if self.engine.spec.classifier is not None:
            raise InvalidRequest("the model is a cross-encoder: it gives scores, not embeddings", param="model")
        params = PoolingParams(
            config=self.engine.spec.pooling, dimensions=dimensions, truncate_prompt_tokens=truncate_prompt_tokens
        )
        async for output in self.generate(prompt_token_ids, params, request_id):
            if isinstance(output, PoolingOutput):
                return output
        raise RuntimeError(f"embedding request {request_id} ended without its embedding")

    @property
    def encoder(self) -> bool:
        """A bidirectional encoder: it embeds, never generates or scores."""
        return self.engine.spec.encoder

    @property
    def classifier(self):  # engine.model.classifier.Classifier | None
        """A cross-encoder's classifier (it scores, never generates), or None."""
        return self.engine.spec.classifier

    async def score(
        self,
        prompt_token_ids: list[int],
        request_id: str,
        *,
        truncate_prompt_tokens: int | None = None,
        activation: bool = True,
        token_type_ids: list[int] | None = None,
    ) -> PoolingOutput:
        """A cross-encoder's label scores for one prompt (`embedding` holds them); raises its error instead.
        token_type_ids: each token's text of the pair (0 or 1), for a model that reads them (BERT)."""
        spec = self.engine.spec
        if spec.classifier is None:
            raise InvalidRequest("the model is not a cross-encoder: it has no score head", param="model")
        params = PoolingParams(
            config=spec.pooling,
            dimensions=None,
            truncate_prompt_tokens=truncate_prompt_tokens,
            head=spec.score_head,
            activation=activation,
            label_activation=spec.classifier.activation,
            token_type_ids=token_type_ids,
        )
        async for output in self.generate(prompt_token_ids, params, request_id):
            if isinstance(output, PoolingOutput):
                return output
        raise RuntimeError(f"score request {request_id} ended without its score")

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams | PoolingParams,
        request_id: str,
        images: list[ImageData] | None = None,
    ) -> AsyncIterator[RequestOutput | PoolingOutput]:
        """Streams the request's outputs; raises its error instead. Closing or cancelling aborts it. images: the
        files of the prompt's images, in prompt order (decoded off the event loop)."""
        if self._stopped:
            raise RuntimeError("the engine is shut down")
        if self._refusal is not None:
            raise self._refusal
        if request_id in self._streams:
            raise InvalidRequest(f"request id {request_id!r} is already running", param="request_id")
        observer = self._observer if isinstance(params, SamplingParams) else None
        clock = RequestClock(observer) if observer is not None else None
        if self.engine.spec.classifier is not None and isinstance(params, SamplingParams):
            raise InvalidRequest(
                f"the model is a cross-encoder ({self.engine.spec.architecture}): it scores prompts "
                "and does not generate text",
                param="model",
            )
        if self.engine.spec.encoder and isinstance(params, SamplingParams):
            raise InvalidRequest(
                f"the model is an encoder ({self.engine.spec.architecture}): it only embeds (/v1/embeddings)",
                param="model",
            )
        args = (prompt_token_ids, params, images)
        request = await asyncio.to_thread(self.engine.prepare, *args) if images else self.engine.prepare(*args)
        if request.grammar is not None:
            await self._compiled(request.grammar)  # a bad schema, regex or grammar fails here, before it starts
        loop = asyncio.get_running_loop()
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, stream)
        self._post(AddRequest(request_id, request))
        done = failed = False
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    done = failed = True
                    raise item
                done = item.finished
                if clock is not None:
                    clock.arrived(item)
                yield item
                if done:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not done:
                self._post(Abort(request_id))
            if clock is not None and not failed:
                clock.end()

    async def _compiled(self, future: Future) -> None:
        """Waits for the request's grammar (compiled on the engine's compile thread); raises InvalidRequest."""
        if not future.done():
            # NOTE: not asyncio.wrap_future: cancelling this request would cancel a compile others may share.
            loop = asyncio.get_running_loop()
            ready = loop.create_future()

            def wake(_: object) -> None:
                def settle() -> None:
                    if not ready.done():
                        ready.set_result(None)

                try:
                    loop.call_soon_threadsafe(settle)
                except RuntimeError:  # the caller's loop is closed
                    pass

            future.add_done_callback(wake)
            await ready
        future.result()

    @property
    def adapters(self) -> list[str]:
        """The names of the LoRA adapters served now."""
        return list(self.engine.adapters)

    @property
    def adapters_at_run_time(self) -> bool:
        """Whether adapters may be loaded and unloaded while serving (LoraConfig.runtime)."""
        return self.engine.config.lora is not None and self.engine.config.lora.runtime

    async def load_adapter(self, name: str, folder: str) -> None:
        """Reads and checks the adapter off the engine's thread, then installs it between two steps."""
        if not self.adapters_at_run_time:
            raise InvalidRequest("adapters are not loaded at run time on this engine", param="lora_name")
        adapter = await asyncio.to_thread(self.engine.lora.read, name, folder)
        await self._between_steps(self.engine.install_adapter, name, adapter)

    async def unload_adapter(self, name: str) -> None:
        if not self.adapters_at_run_time:
            raise InvalidRequest("adapters are not unloaded at run time on this engine", param="lora_name")
        await self._between_steps(self.engine.remove_adapter, name)

    async def _between_steps(self, call, *args) -> None:
        done: Future = Future()
        self._post(CallOnLoop(call, args, done))
        await asyncio.wrap_future(done)

    def abort(self, request_id: str) -> None:
        """Ends the request: its pages are freed before the next step, its stream gets a last "abort" output."""
        self._post(Abort(request_id))

    @property
    def num_running(self) -> int:
        """Requests whose streams are open."""
        return len(self._streams)

    def fail_all(self, error: BaseException) -> int:
        """Ends every running request with `error` (its stream raises it), frees their pages, and refuses new
        requests with the same error from now on; returns how many were running."""
        self._refusal = error
        running = list(self._streams)
        for request_id in running:
            self._deliver(request_id, error)
            self._post(Abort(request_id))
        return len(running)

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)
        self.engine.grammars.shutdown()
        self.engine.close()

    def _post(self, command: Command) -> None:
        self._inbox.put(command)
        self._wake.set()

    def _deliver(self, request_id: str, item: RequestOutput | PoolingOutput | BaseException) -> None:
        target = self._streams.get(request_id)
        if target is None:
            return
        loop, stream = target
        try:
            loop.call_soon_threadsafe(stream.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody listens any more
            self._streams.pop(request_id, None)
            self.engine.abort(request_id)

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            match command:
                case Fatal(error):
                    raise error
                case AddRequest(request_id, request):
                    if request_id not in self._streams:
                        continue  # cancelled before it started
                    try:
                        self.engine.add(request_id, request)
                    except Exception as exc:
                        self._deliver(request_id, exc)
                case CallOnLoop(call, args, done):
                    try:
                        done.set_result(call(*args))
                    except Exception as exc:
                        done.set_exception(exc)
                case Abort(request_id):
                    output = self.engine.abort(request_id)
                    if output is not None:
                        self._deliver(request_id, output)

    def _loop(self) -> None:
        while not self._stopped:
            try:
                self._drain_inbox()
                if not self.engine.has_unfinished():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
            except RankFailed as exc:  # the engine cannot run any more: every request, now and later, gets why
                log.critical("engine stopped: %s", exc.message)
                self.fail_all(exc)  # new requests are refused with it from now on
                self.engine.abort_all()
                if self._on_fatal is not None:
                    self._on_fatal(exc)
                break
            except Exception as exc:  # a bug outside any one request: fail what runs, keep serving
                log.exception("engine loop failed")
                for request_id in self.engine.abort_all():
                    self._deliver(request_id, exc)
                continue
            for output in outputs:
                self._deliver(output.request_id, output)
            for request_id, error in self.engine.pop_failures():
                self._deliver(request_id, error)
        for request_id in list(self._streams):
            self._deliver(request_id, RuntimeError("the engine shut down"))
        while not self._inbox.empty():  # adapter loads waiting for a step that will not come
            command = self._inbox.get_nowait()
            if isinstance(command, CallOnLoop):
                command.done.set_exception(RuntimeError("the engine shut down"))
