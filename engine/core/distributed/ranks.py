"""The one owner of the tensor-parallel rank processes: starts ranks 1..N-1 (torch.multiprocessing spawn), joins
them in a process group (gloo on CPU, NCCL on CUDA), sends them each step, watches them, and ends them.

Commands go down a pipe to each rank (a fixed-size header: idle ranks wait on it as long as the worker is idle, and
writing it never waits on a rank), the step's data by broadcast in the group. A rank that exits ends the engine: a
watchdog thread sees its process end at once and reports it (on_failure); a rank that hangs fails the next
collective after `timeout_s`. Every rank exits when rank 0's process is gone, so nothing outlives the worker.
"""

from __future__ import annotations

import atexit
import json
import logging
import socket
import threading
from collections.abc import Callable
from dataclasses import replace
from multiprocessing.connection import wait
from typing import cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.attention.base import AttentionMetadata
from engine.config import EngineConfig
from engine.core.device import available_cpus
from engine.core.distributed import wire
from engine.core.distributed.groups import join_groups
from engine.core.scheduling.step import SchedulerOutput
from engine.errors import RankFailed, StartupError
from engine.model.layers.lora import LoraSet
from engine.model.layers.parallel import TensorParallel
from engine.model.layers.recurrent_step import RecurrentStep
from engine.model.loader import shard_refusal

log = logging.getLogger(__name__)

JOIN_S = 10.0  # how long a rank gets to leave on STOP before it is killed


def resolve_size(value: int | str, device: torch.device) -> int:
    """TENSOR_PARALLEL_SIZE as a number: `auto` is the visible CUDA devices (1 on a CPU); StartupError naming the
    number for a size below 1 or more ranks than CUDA devices."""
    cuda = device.type == "cuda"
    if value == "auto":
        return torch.cuda.device_count() if cuda else 1
    try:
        size = int(value)
    except (TypeError, ValueError):
        raise StartupError(
            f"tensor_parallel_size {value!r} is not a number or 'auto'", param="tensor_parallel_size"
        ) from None
    if size < 1:
        raise StartupError(f"tensor_parallel_size={size} must be at least 1", param="tensor_parallel_size")
    if cuda and size > torch.cuda.device_count():
        raise StartupError(
            f"tensor_parallel_size={size} is more ranks than the {torch.cuda.device_count()} CUDA devices visible",
            param="tensor_parallel_size",
        )
    return size


def rank_config(config: EngineConfig, device: torch.device) -> EngineConfig:
    """The config with tensor_parallel_size a number; above 1, StartupError in one line for what does not run
    sharded yet (before any rank starts), and each rank's CPU threads (an equal share of this process's CPUs
    unless OMP_NUM_THREADS says)."""
    size = resolve_size(config.tensor_parallel_size, device)
    config = replace(config, tensor_parallel_size=size)
    if size == 1:
        return config
    if config.quantization is not None:
        raise StartupError(
            f"tensor_parallel_size={size}: QUANTIZATION does not run tensor-parallel yet", param="tensor_parallel_size"
        )
    method = config.speculative.method if config.speculative is not None else None
    if method in ("eagle3", "mtp"):  # NOTE: the head would call the sharded embedding and lm_head on rank 0 alone
        raise StartupError(
            f"tensor_parallel_size={size}: speculative method {method} does not run tensor-parallel "
            "yet (ngram and draft_model do)",
            param="tensor_parallel_size",
        )
    why = shard_refusal(config.model_path, size)  # the bake lists the sizes this passes
    if why is not None:
        raise StartupError(why, param="tensor_parallel_size")
    if device.type == "cpu" and config.cpu_threads is None:
        config = replace(config, cpu_threads=max(1, available_cpus() // size))
    return config


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RankSet:
    """Rank 0's side: the other ranks' processes, the groups, and the commands sent to them."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        from engine.core.distributed.follower import follower_main

        size = config.tensor_parallel_size
        assert isinstance(size, int), "tensor_parallel_size auto is resolved before the ranks start"
        self.size, self.device = size, device
        # Told (on the watchdog's thread) when a rank fails; AsyncEngine sets it to wake its loop.
        self.on_failure: Callable[[RankFailed], None] | None = None
        self.failure: RankFailed | None = None
        self._closing = False
        self._lock = threading.Lock()
        # NOTE: one thread at a time reaps a process: two concurrent waitpid calls leave one with ECHILD, and
        # multiprocessing then takes the dead process for a live one.
        self._reap = threading.Lock()
        timeout = config.tensor_parallel_timeout_s
        port = _free_port()
        context = mp.get_context("spawn")
        pipes = [context.Pipe(duplex=False) for _ in range(1, size)]
        self.commands = [writer for _, writer in pipes]
        self.processes = [
            context.Process(
                target=follower_main, args=(r, size, port, config, timeout, reader), daemon=True, name=f"tp-rank-{r}"
            )
            for r, (reader, _) in enumerate(pipes, 1)
        ]
        for p in self.processes:
            p.start()
        for reader, _ in pipes:
            reader.close()
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()
        atexit.register(self.close)
        backend = "nccl" if device.type == "cuda" else "gloo"
        try:
            data = join_groups(backend, port, 0, size, timeout)
        except Exception as exc:
            self.close()
            raise self._startup_error(exc) from None
        self.tp = TensorParallel(0, size, data)

    def _startup_error(self, exc: BaseException) -> StartupError:
        dead = [
            f"rank {r} exited with code {p.exitcode}" for r, p in enumerate(self.processes, 1) if p.exitcode is not None
        ]
        cause = "; ".join(dead) + " (its error is logged above)" if dead else f"{type(exc).__name__}: {exc}"
        return StartupError(
            f"tensor_parallel_size={self.size}: the ranks did not start: {cause}", param="tensor_parallel_size"
        )

    def _watch(self) -> None:
        alive = {p.sentinel: (r, p) for r, p in enumerate(self.processes, 1)}
        while alive:
            for sentinel in wait(list(alive)):
                rank, process = alive.pop(cast(int, sentinel))  # wait() returns the ready ones of those given
                with self._reap:
                    process.join()
                if self._closing:
                    continue
                self._fail(
                    RankFailed(
                        f"tensor-parallel rank {rank} (pid {process.pid}) exited with code "
                        f"{process.exitcode}: the engine cannot run without it"
                    )
                )

    def _fail(self, exc: RankFailed) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = exc
        log.error("%s", exc.message)
        self._end_processes(grace=0.0)
        if self.on_failure is not None:
            self.on_failure(exc)

    def fail(self, cause: BaseException) -> RankFailed:
        """A collective failed on rank 0 (a rank died or timed out): the ranks are out of step, so they all end."""
        self._fail(
            RankFailed(
                f"tensor-parallel step failed ({type(cause).__name__}: {cause}): the ranks are out "
                "of step and have been stopped"
            )
        )
        assert self.failure is not None  # this one, or the one that came first
        return self.failure

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure

    # ---- commands (rank 0 only, on the engine's thread)
    def share_cache(self, num_pages: list[int], state_slots: int = 0) -> RankSet:
        """Tells every rank how many pages each KV group's pool has and how many slots the recurrent-state pool has
        (rank 0 sized them; 0: no recurrent layers); returns self, the peers of rank 0's model runner."""
        if len(num_pages) > wire.MAX_GROUPS:
            raise StartupError(
                f"tensor parallelism runs at most {wire.MAX_GROUPS} KV layer groups", param="tensor_parallel_size"
            )
        self._send(wire.header(wire.CACHE, len(num_pages), state_slots, *num_pages))
        return self

    def send_step(
        self,
        out: SchedulerOutput,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metas: list[AttentionMetadata],
        recurrent: RecurrentStep | None = None,
        lora: LoraSet | None = None,
        image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """The step's inputs (out: its page and state-slot copies; lora: rank 0's adapters, whose plan holds the
        step's rows per adapter; image_embeds: the (rows, values) of its image tokens, which rank 0 encoded)."""
        runs = lora.plan.runs if lora is not None else ()
        head, payload = wire.pack_step(
            out.copies, input_ids, positions, metas, out.state_copies, recurrent, runs, image_embeds
        )
        self._send(head)
        dist.broadcast(payload, src=0, group=self.tp.group)
        if image_embeds is not None:
            dist.broadcast(image_embeds[1].contiguous(), src=0, group=self.tp.group)

    def send_logits(self, hidden: torch.Tensor, exact_rows: torch.Tensor | None) -> None:
        """The rows every rank turns into its part of the logits next (gathered on rank 0 by compute_logits)."""
        exact = -1 if exact_rows is None else exact_rows.numel()
        self._send(wire.header(wire.LOGITS, hidden.shape[0], exact))
        dist.broadcast(hidden.contiguous(), src=0, group=self.tp.group)
        if exact_rows is not None and exact > 0:
            dist.broadcast(exact_rows.to(torch.int64), src=0, group=self.tp.group)

    def send_settle(self, accepted: dict[int, int]) -> None:
        """The rows of each verified sequence of the last step that were kept: every rank replays them into its
        recurrent states (RecurrentPlan.settle) before the next step."""
        self._send(wire.header(wire.SETTLE), json.dumps(sorted(accepted.items())).encode())

    def install_adapter(self, slot: int, name: str, folder: str) -> None:
        """Every rank reads its part of the adapter in `folder` into `slot` (rank 0's, just installed), before the
        next step."""
        self._send(wire.header(wire.LORA, slot), json.dumps([name, folder]).encode())

    def _send(self, head: torch.Tensor, *more: bytes) -> None:
        self.check()
        messages = [head.numpy().tobytes(), *more]
        for pipe in self.commands:
            for message in messages:
                pipe.send_bytes(message)

    # ---- the end
    def close(self) -> None:
        """Stops every rank (STOP, then terminate and kill what does not leave) and leaves the process group."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        if self.failure is None:
            try:
                self._send(wire.header(wire.STOP))
            except Exception:  # a rank already gone: the kill below ends the rest
                pass
        for pipe in self.commands:
            pipe.close()
        self._end_processes(grace=JOIN_S)
        if dist.is_initialized():
            dist.destroy_process_group()
        atexit.unregister(self.close)

    def _end_processes(self, grace: float) -> None:
        with self._reap:
            for p in self.processes:
                p.join(timeout=grace)
            for p in self.processes:
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=2.0)
                if p.is_alive():
                    p.kill()
                    p.join()
