"""A real redis-server for tests, on a free loopback port, with nothing written to disk. Tests that need one skip,
saying why, where the binary is missing (`make test` installs the Debian package where it can)."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from local_worker import free_port
from waiting import wait_until


def redis_or_skip() -> str:
    path = shutil.which("redis-server")
    if path is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; `make test` tries that)")
    return path


@contextmanager
def redis_server() -> Iterator[str]:
    """Runs redis-server until the block ends; yields its redis:// URL once it answers PING."""
    import redis

    port = free_port()
    process = subprocess.Popen(
        [redis_or_skip(), "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url = f"redis://127.0.0.1:{port}/0"
    client = redis.Redis.from_url(url, socket_connect_timeout=1)

    def answers() -> bool:
        assert process.poll() is None, f"redis-server exited with {process.returncode}"
        try:
            return bool(client.ping())
        except redis.ConnectionError:
            return False

    try:
        wait_until(answers, "redis-server answering PING", timeout_s=60)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
