"""Every FlashInfer module a registered family can ask for compiles for Hopper (sm_90a) with this machine's nvcc,
through the command the Dockerfile runs (engine.core.kernel_plan), in one ninja. No GPU: nothing compiled is run.

Behind the `compile` marker (hours on 2 cores, minutes on 16): `pytest -m compile tests/engine/cuda`. MAX_JOBS caps
nvcc's processes; HOPPER_COMPILE_WORKSPACE keeps the cache between runs (default: a temporary folder);
HOPPER_COMPILE_ONLY (a regex of module names) builds a subset.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.cuda.kernels import flashinfer_import_error

ROOT = Path(__file__).resolve().parents[3]
ARCH = "9.0a"
pytestmark = pytest.mark.compile


def cuda_home() -> Path:
    """CUDA_HOME, else the toolkit nvcc belongs to (FlashInfer's own guess takes a wrapper script's folder)."""
    if os.environ.get("CUDA_HOME"):
        return Path(os.environ["CUDA_HOME"])
    nvcc = Path(shutil.which("nvcc")).resolve()
    for line in nvcc.read_text(errors="ignore").splitlines()[:5] if nvcc.stat().st_size < 4096 else []:
        if "exec " in line:  # a wrapper: exec /usr/local/cuda-x/bin/nvcc "$@"
            nvcc = Path(line.split()[1])
    return nvcc.parent.parent


def link_flags(home: Path, scratch: Path) -> str:
    """FlashInfer links every module with -lcuda; a machine without a driver and without CUDA's stubs gets an
    empty stand-in (the soname a driver's libcuda.so.1 answers to), which is all the linker needs."""
    if any((home / sub / "libcuda.so").exists() for sub in ("lib64", "lib64/stubs")):
        return os.environ.get("FLASHINFER_EXTRA_LDFLAGS", "")
    scratch.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["cc", "-shared", "-Wl,-soname,libcuda.so.1", "-o", str(scratch / "libcuda.so"), "-x", "c", "/dev/null"],
        check=True,
    )
    return f"-L{scratch} {os.environ.get('FLASHINFER_EXTRA_LDFLAGS', '')}".strip()


def header_flags(home: Path) -> str:
    """FlashInfer's norm includes cublasLt.h; a toolkit without cuBLAS's headers (CUDA's devel image has them) takes
    them from torch's CUDA wheels."""
    extra = os.environ.get("FLASHINFER_EXTRA_CUDAFLAGS", "")
    if (home / "include" / "cublasLt.h").exists():
        return extra
    import nvidia

    found = [p.parent for root in nvidia.__path__ for p in Path(root).glob("*/include/cublasLt.h")]
    return f"-isystem {found[0]} {extra}".strip() if found else extra


def test_every_family_module_builds_for_hopper(tmp_path: Path) -> None:
    if flashinfer_import_error() is not None:
        pytest.skip(f"flashinfer does not import here: {flashinfer_import_error()!r}")
    if shutil.which("nvcc") is None or shutil.which("ninja") is None:
        pytest.skip("nvcc and ninja are needed to compile FlashInfer's modules")
    home = cuda_home()
    workspace = Path(os.environ.get("HOPPER_COMPILE_WORKSPACE", tmp_path / "flashinfer"))
    env = {
        **os.environ,
        "CUDA_HOME": str(home),
        "FLASHINFER_WORKSPACE_BASE": str(workspace),
        "FLASHINFER_EXTRA_LDFLAGS": link_flags(home, tmp_path / "libcuda-stub"),
        "FLASHINFER_EXTRA_CUDAFLAGS": header_flags(home),
        "MAX_JOBS": os.environ.get("MAX_JOBS", str(os.cpu_count() or 1)),
    }
    only = ["--only", os.environ["HOPPER_COMPILE_ONLY"]] if os.environ.get("HOPPER_COMPILE_ONLY") else []
    command = [sys.executable, "-m", "engine.core.kernel_plan", "--all-families", "--arch", ARCH, *only]
    listed = subprocess.run([*command, "--list"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert listed.returncode == 0, listed.stderr[-3000:]
    names = listed.stdout.split()
    start = time.monotonic()
    built = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=6 * 3600)
    wall = time.monotonic() - start
    # PrecompileError names every module that did not build (ninja -k 0), with nvcc's first lines about each.
    assert built.returncode == 0, built.stderr[-6000:]
    libraries = {p.parent.name for p in workspace.rglob("cached_ops/*/*.so") if p.parts[-4] == "90a"}
    assert not set(names) - libraries, sorted(set(names) - libraries)
    print(f"{len(names)} modules built for sm_{ARCH.replace('.', '')} in {wall:.0f} s (MAX_JOBS={env['MAX_JOBS']})")
