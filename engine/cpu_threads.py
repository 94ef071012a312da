"""How many threads torch runs on CPU: the CPUs this process may use, capped by its container's CPU quota.

NOTE: torch sizes its thread pool from the CPUs it can see. A container limited by a CFS quota (docker
--cpus, Kubernetes CPU limits) still sees every CPU of the host, and a pool wider than the quota spends its
time throttled and waiting at barriers: a step can run several times slower than with the right width.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

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
                quota = int((v1 / "cpu.cfs_quota_us").read_text())
                return None if quota <= 0 else quota / int((v1 / "cpu.cfs_period_us").read_text())
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
