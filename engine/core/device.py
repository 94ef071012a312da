"""Where the engine runs: the device, the serving dtype (and why), and torch's CPU thread pool.

NOTE: torch sizes its thread pool from the CPUs it can see. A container limited by a CFS quota (docker
--cpus, Kubernetes CPU limits) still sees every CPU of the host, and a pool wider than the quota spends its
time throttled and waiting at barriers: a step can run several times slower than with the right width.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from engine.errors import InvalidRequest

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


CGROUP_ROOT = Path("/sys/fs/cgroup")


def cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs' worth of time the cgroup may use (cgroup v2 cpu.max, else v1 CFS files); None when unlimited
    or unreadable."""
    try:
        v2 = root / "cpu.max"
        if v2.is_file():
            quota, _, period = v2.read_text().strip().partition(" ")
            return None if quota == "max" else int(quota) / int(period)
        for v1 in (root / "cpu", root / "cpu,cpuacct"):
            if (v1 / "cpu.cfs_quota_us").is_file():
                cfs_quota = int((v1 / "cpu.cfs_quota_us").read_text())
                return None if cfs_quota <= 0 else cfs_quota / int((v1 / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError, ZeroDivisionError):
        pass
    return None


def available_cpus(root: Path = CGROUP_ROOT) -> int:
    """The CPUs this process may be scheduled on, at most its quota rounded up (never below 1)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    quota = cpu_quota(root)
    return cpus if quota is None else max(1, min(cpus, math.ceil(quota)))


def size_thread_pool(threads: int | None = None, root: Path = CGROUP_ROOT) -> int:
    """Sets torch's intra-op pool to `threads`, or, when None, narrows it to available_cpus(); returns the width."""
    if threads is not None:
        torch.set_num_threads(threads)
    else:
        cpus = available_cpus(root)
        if cpus < torch.get_num_threads():
            torch.set_num_threads(cpus)
    return torch.get_num_threads()
