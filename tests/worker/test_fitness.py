"""Fitness checks: `python handler.py` as RunPod starts it (RUNPOD_WEBHOOK_GET_JOB set) runs the worker's checks
through the SDK before it asks for a job. A bake whose weight file was corrupted after the bake exits 1 without
asking; the intact bake asks for its first job. The job-take URL is a real local HTTP server that counts calls."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from local_worker import ROOT, worker_env
from waiting import wait_until

from worker.fitness import model_files_mismatch


class JobTakes:
    """A job-take endpoint that hands out no job and remembers each request."""

    def __init__(self) -> None:
        self.paths: list[str] = []
        takes = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                takes.paths.append(self.path)
                self.send_response(204)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/job-take/$RUNPOD_POD_ID?gpu=test"


@pytest.fixture
def takes() -> Iterator[JobTakes]:
    t = JobTakes()
    yield t
    t.server.shutdown()


def _start(model_path: Path, takes: JobTakes, log: Path) -> subprocess.Popen:
    env = worker_env(model_path, RUNPOD_WEBHOOK_GET_JOB=takes.url(), RUNPOD_POD_ID="fitness-test",
                     RUNPOD_SKIP_AUTO_SYSTEM_CHECKS="true")  # the SDK's disk and memory checks: not ours
    with log.open("w") as out:
        return subprocess.Popen([sys.executable, str(ROOT / "handler.py")], cwd=ROOT, env=env, stdout=out,
                                stderr=subprocess.STDOUT)


def test_a_corrupted_weight_file_fails_the_check_and_the_worker_exits_before_taking_a_job(
        baked_model_path, takes, tmp_path) -> None:
    bake = tmp_path / "model"
    shutil.copytree(baked_model_path, bake)
    weights = bake / "model.safetensors"
    with weights.open("r+b") as f:  # the last bytes are tensor data: the weights still load, their sum differs
        f.seek(-64, 2)
        f.write(bytes(64))
    assert model_files_mismatch(str(bake)) == ["model.safetensors"]
    process = _start(bake, takes, tmp_path / "worker.log")
    try:
        code = process.wait(timeout=600)  # a guard against a hung worker: it exits once its checks ran
    finally:
        process.kill()
    log = (tmp_path / "worker.log").read_text()
    assert code == 1, log[-3000:]
    assert "model_files_match_manifest" in log and "model.safetensors" in log, log[-3000:]
    assert takes.paths == []


def test_an_intact_worker_passes_its_checks_and_asks_for_a_job(baked_model_path, takes, tmp_path) -> None:
    assert model_files_mismatch(str(baked_model_path)) == []
    process = _start(baked_model_path, takes, tmp_path / "worker.log")
    try:
        wait_until(lambda: takes.paths or process.poll() is not None, "the worker asks for a job or exits")
        log = (tmp_path / "worker.log").read_text()
        assert process.poll() is None and takes.paths, log[-3000:]
        assert "All fitness checks passed" in log, log[-3000:]
    finally:
        process.terminate()
        process.wait(timeout=60)
