"""A rank other than 0: joins the process group, loads its shard (and its part of every LoRA adapter; no vision tower:
rank 0 sends the image tokens' embeddings), holds its KV pages (its heads' share of every page rank 0's scheduler
hands out), and runs what rank 0 sends until STOP; it exits when rank 0's process is gone.
"""

from __future__ import annotations

import json
import os
import threading
import time

import torch
import torch.distributed as dist

from engine.attention import create_group_backends, resolve_backend
from engine.attention.kv_quant import resolve_kv_dtype
from engine.config import EngineConfig
from engine.core.device import resolve_device, resolve_dtype, size_thread_pool
from engine.core.distributed import wire
from engine.core.distributed.groups import join_groups
from engine.core.kv.cache import PagePool
from engine.core.kv.state_cache import StatePool
from engine.core.model_runner import ModelRunner
from engine.model.layers.parallel import TensorParallel
from engine.model.loader import load_model
from engine.sample.sampler import Sampler

PARENT_POLL_S = 1.0


def _exit_with_parent(parent: int) -> None:
    """Rank 0 killed outright runs no clean-up: this rank then leaves on its own within PARENT_POLL_S."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(3)


def follower_main(rank: int, size: int, port: int, config: EngineConfig, timeout_s: float, commands) -> None:
    """The process of rank `rank`: `commands` is the read end of rank 0's pipe to it."""
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), name="tp-parent", daemon=True).start()
    device = resolve_device(config.device)
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        size_thread_pool(config.cpu_threads)
    data = join_groups("nccl" if device.type == "cuda" else "gloo", port, rank, size, timeout_s)
    try:
        Follower(config, TensorParallel(rank, size, data), commands, device).serve()
    except EOFError:  # rank 0 closed its end without a STOP: it is gone
        pass
    finally:
        dist.destroy_process_group()


class Follower:
    """One rank's model shard, pools and backends, driven by rank 0's commands."""

    def __init__(self, config: EngineConfig, tp: TensorParallel, commands, device: torch.device) -> None:
        self.config, self.tp, self.commands, self.device = config, tp, commands, device
        torch.manual_seed(config.seed)
        self.dtype, _ = resolve_dtype(config.dtype, device, config.quantization)
        self.model, self.spec = load_model(
            config.model_path, self.dtype, device, lora=config.lora, tp=tp, max_model_len=config.max_model_len
        )
        self.kv_dtype = resolve_kv_dtype(config.kv_cache_dtype, self.dtype)
        self.backend_name, _ = resolve_backend(config.attention_backend, device, self.dtype)
        self.runner: ModelRunner | None = None

    def _receive(self) -> torch.Tensor:
        return torch.frombuffer(bytearray(self.commands.recv_bytes()), dtype=torch.int64)

    def serve(self) -> None:
        while True:
            head = self._receive()
            command = int(head[0])
            if command == wire.STOP:
                return
            if command == wire.CACHE:
                self._build_cache(head[3 : 3 + int(head[1])].tolist(), int(head[2]))
            elif command == wire.STEP:
                self._step(head)
            elif command == wire.LOGITS:
                self._logits(int(head[1]), int(head[2]))
            elif command == wire.SETTLE:  # a verify's kept rows, replayed into this rank's recurrent states
                self.runner.recurrent_plan.settle(dict(json.loads(self.commands.recv_bytes())))
            elif command == wire.LORA:  # an adapter loaded while serving: this rank's part of it, in rank 0's slot
                name, folder = json.loads(self.commands.recv_bytes())
                self.model.lora.write(int(head[1]), self.model.lora.read(name, folder))
            else:
                raise RuntimeError(f"rank {self.tp.rank}: unknown command {command} from rank 0")

    def _build_cache(self, num_pages: list[int], state_slots: int) -> None:
        groups, ps, recurrent = self.spec.kv_groups, self.config.page_size, self.spec.recurrent
        pools = [
            PagePool.for_group(g, n, ps, self.kv_dtype, self.device) for g, n in zip(groups, num_pages, strict=True)
        ]
        backends = create_group_backends(
            self.backend_name,
            groups,
            self.device,
            spec=self.spec,
            dtype=self.dtype,
            kv_dtype=self.kv_dtype,
            requested=self.config.attention_backend,
        )
        # This rank's heads' states, in as many slots as rank 0's pool (the slot ids are its scheduler's).
        states = None if recurrent is None else StatePool(recurrent, state_slots, self.dtype, self.device)
        self.runner = ModelRunner(
            model=self.model,
            groups=groups,
            pools=pools,
            backends=backends,
            sampler=Sampler(),
            device=self.device,
            recurrent=recurrent,
            state_pool=states,
        )

    @torch.inference_mode()
    def _step(self, head: torch.Tensor) -> None:
        payload = torch.empty(wire.payload_len(head), dtype=torch.int64, device=self.device)
        dist.broadcast(payload, src=0, group=self.tp.group)
        step = wire.unpack_step(head, payload, self.config.page_size)
        runner = self.runner
        for pool, copies in zip(runner.pools, step.copies, strict=True):
            pool.copy_pages([s for s, _ in copies], [d for _, d in copies])
        if self.model.lora is not None:
            self.model.lora.plan.update(step.lora_runs, self.device)
        if step.recurrent is not None:
            runner.state_pool.copy_slots(step.state_copies)
            runner.recurrent_plan.plan(step.recurrent)
        for backend, meta in zip(runner.backends, step.metas, strict=True):
            backend.plan(meta)
        extra = {}
        if step.image_embeds is not None:  # rank 0's tower's output for the step's image rows
            dist.broadcast(step.image_embeds[1], src=0, group=self.tp.group)
            extra["image_embeds"] = step.image_embeds
        self.model(step.input_ids, step.positions, step.metas[0], runner.layer_caches, runner.layer_backends, **extra)

    @torch.inference_mode()
    def _logits(self, rows: int, exact: int) -> None:
        hidden = torch.empty((rows, self.spec.hidden_size), dtype=self.dtype, device=self.device)
        dist.broadcast(hidden, src=0, group=self.tp.group)
        exact_rows = None
        if exact >= 0:
            exact_rows = torch.empty(exact, dtype=torch.int64, device=self.device)
            if exact:
                dist.broadcast(exact_rows, src=0, group=self.tp.group)
        self.model.compute_logits(hidden, exact_rows)
