"""CPU thread sizing: the container's CPU quota (cgroup v2 and v1) caps torch's pool; a width asked for wins."""

from __future__ import annotations

import os

import pytest
import torch

from engine.core.device import available_cpus, cpu_quota, size_thread_pool


def write(root, relative: str, text: str) -> None:
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def threads():
    """Restores torch's pool width after a test changes it."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("text", "cpus"), [("max 100000\n", None), ("150000 100000\n", 1.5), ("400000 100000", 4.0)])
def test_cgroup_v2_quota(tmp_path, text, cpus):
    write(tmp_path, "cpu.max", text)
    assert cpu_quota(tmp_path) == cpus


@pytest.mark.parametrize("folder", ["cpu", "cpu,cpuacct"])
def test_cgroup_v1_quota(tmp_path, folder):
    write(tmp_path, f"{folder}/cpu.cfs_period_us", "100000\n")
    write(tmp_path, f"{folder}/cpu.cfs_quota_us", "-1\n")
    assert cpu_quota(tmp_path) is None
    write(tmp_path, f"{folder}/cpu.cfs_quota_us", "250000\n")
    assert cpu_quota(tmp_path) == 2.5


def test_no_or_unreadable_cgroup_files_mean_no_quota(tmp_path):
    assert cpu_quota(tmp_path) is None
    write(tmp_path, "cpu.max", "garbage")
    assert cpu_quota(tmp_path) is None


def test_available_cpus_is_the_affinity_capped_by_the_quota_rounded_up(tmp_path):
    affinity = len(os.sched_getaffinity(0))
    assert available_cpus(tmp_path) == affinity
    write(tmp_path, "cpu.max", "50000 100000")
    assert available_cpus(tmp_path) == 1
    write(tmp_path, "cpu.max", f"{affinity * 100000 - 50000} 100000")
    assert available_cpus(tmp_path) == affinity
    write(tmp_path, "cpu.max", f"{(affinity + 8) * 100000} 100000")
    assert available_cpus(tmp_path) == affinity


def test_the_pool_narrows_to_the_quota(tmp_path, threads):
    torch.set_num_threads(2)
    write(tmp_path, "cpu.max", "100000 100000")
    assert size_thread_pool(root=tmp_path) == 1
    assert torch.get_num_threads() == 1


def test_the_pool_never_widens(tmp_path, threads):
    torch.set_num_threads(1)
    write(tmp_path, "cpu.max", "800000 100000")
    assert size_thread_pool(root=tmp_path) == 1


def test_a_width_asked_for_overrides_the_quota(tmp_path, threads):
    # the worker asks for OMP_NUM_THREADS' width (worker/settings.py)
    torch.set_num_threads(1)
    write(tmp_path, "cpu.max", "100000 100000")
    assert size_thread_pool(2, root=tmp_path) == 2
