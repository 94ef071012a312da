"""Fitness checks: `python handler.py` as RunPod starts it (RUNPOD_WEBHOOK_GET_JOB set) runs the worker's checks
through the SDK before it asks for a job. With VERIFY_MODEL_SHA256=true a bake whose weight file was corrupted
after the bake exits 1 without asking; by default (sizes only) that bake, like an intact one, asks for its first
job, and one missing a file exits 1. The job-take URL is a real local HTTP server that counts calls."""

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


@pytest.fixture(scope="module")
def fresh_bake(baked_model_path, tmp_path_factory) -> Path:
    """The default model baked anew by this builder, so its manifest records the files' sizes."""
    from builder.bake import bake
    from builder.sources import resolve

    out = tmp_path_factory.mktemp("fresh") / "model"
    bake(resolve(str(baked_model_path), None), out)
    return out


def corrupted_copy(bake: Path, folder: Path) -> Path:
    """A copy of `bake` whose weight file has its last bytes changed: the same size, the weights still load (the
    last bytes are tensor data), their SHA-256 differs."""
    copy = shutil.copytree(bake, folder)
    with (copy / "model.safetensors").open("r+b") as f:
        f.seek(-64, 2)
        f.write(bytes(64))
    return copy


def _start(model_path: Path, takes: JobTakes, log: Path, **env_vars: str) -> subprocess.Popen:
    env = worker_env(
        model_path,
        RUNPOD_WEBHOOK_GET_JOB=takes.url(),
        RUNPOD_POD_ID="fitness-test",
        RUNPOD_SKIP_AUTO_SYSTEM_CHECKS="true",
        **env_vars,
    )  # the SDK's disk and memory checks: not ours
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, str(ROOT / "handler.py")], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )


def _exits_before_taking_a_job(process: subprocess.Popen, takes: JobTakes, log_path: Path, name: str) -> None:
    try:
        code = process.wait(timeout=600)  # a guard against a hung worker: it exits once its checks ran
    finally:
        process.kill()
    log = log_path.read_text()
    assert code == 1, log[-3000:]
    assert "model_files_match_manifest" in log and name in log, log[-3000:]
    assert takes.paths == []


def test_with_verify_model_sha256_a_corrupted_weight_file_fails_the_check_before_a_job(
    fresh_bake, takes, tmp_path
) -> None:
    bake = corrupted_copy(fresh_bake, tmp_path / "model")
    assert model_files_mismatch(str(bake), sha256=True) == ["model.safetensors"]
    process = _start(bake, takes, tmp_path / "worker.log", VERIFY_MODEL_SHA256="true")
    _exits_before_taking_a_job(process, takes, tmp_path / "worker.log", "model.safetensors")


def test_by_default_a_missing_file_fails_the_check_before_a_job(fresh_bake, takes, tmp_path) -> None:
    bake = shutil.copytree(fresh_bake, tmp_path / "model")
    (bake / "generation_config.json").unlink()  # the engine starts without it; the manifest lists it
    process = _start(bake, takes, tmp_path / "worker.log")
    _exits_before_taking_a_job(process, takes, tmp_path / "worker.log", "generation_config.json")


@pytest.mark.parametrize("corrupted", [False, True], ids=["intact", "corrupted-bytes-same-size"])
def test_by_default_the_worker_passes_its_checks_and_asks_for_a_job(fresh_bake, takes, tmp_path, corrupted) -> None:
    """The default check reads no weight bytes: changed bytes of the same size pass it (VERIFY_MODEL_SHA256 finds
    them), so its cost does not grow with the model."""
    bake = corrupted_copy(fresh_bake, tmp_path / "model") if corrupted else fresh_bake
    assert model_files_mismatch(str(bake)) == []
    process = _start(bake, takes, tmp_path / "worker.log")
    try:
        wait_until(lambda: takes.paths or process.poll() is not None, "the worker asks for a job or exits")
        log = (tmp_path / "worker.log").read_text()
        assert process.poll() is None and takes.paths, log[-3000:]
        assert "All fitness checks passed" in log, log[-3000:]
    finally:
        process.terminate()
        process.wait(timeout=60)
