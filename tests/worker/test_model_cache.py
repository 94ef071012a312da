"""Serving without a bake: MODEL_NAME's snapshot read in place from a hub cache made here from the baked default
model (blobs named by their SHA-256, a snapshot of links to them, refs/main), through `handler.py` as RunPod
starts it, as the local endpoint, and as a local test job; a missing model names every path looked at."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from hub_cache import COMMIT, NAME, make_cache
from local_worker import ROOT, start_worker, stop_worker, worker_env
from waiting import wait_until

from worker.fitness import model_files_mismatch

CHAT = {
    "openai_route": "/v1/chat/completions",
    "openai_input": {
        "model": NAME,
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 4,
        "temperature": 0,
    },
}


def cache_env(tmp_path: Path, cache: Path, **env: str) -> dict[str, str]:
    """No MODEL_PATH, an empty BASE_PATH and HF_HOME: only `cache` holds the model."""
    (tmp_path / "base").mkdir(exist_ok=True)
    return {
        "MODEL_PATH": "",
        "BASE_PATH": str(tmp_path / "base"),
        "HF_HOME": str(tmp_path / "hf-home"),
        "HF_HUB_CACHE": "",
        "MODEL_CACHE_PATH": str(cache),
        "MODEL_NAME": NAME,
        **env,
    }


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under `root` with its size and modification time, links not followed."""
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in sorted(root.rglob("*"))}


def run_handler(tmp_path: Path, env: dict[str, str], job: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "handler.py"), "--test_input", json.dumps({"input": job})],
        cwd=ROOT,
        env=worker_env(tmp_path / "unused", **env),
        capture_output=True,
        text=True,
        timeout=600,
    )  # a guard against a hung worker


def test_a_lower_cased_cache_folder_is_served_in_place_under_model_name_by_the_local_endpoint(
    baked_model_path, tmp_path
) -> None:
    cache = tmp_path / "runpod-cache"
    snapshot = make_cache(cache, baked_model_path, "models--huggingfacetb--smollm2-135m-instruct")
    before = tree(cache)
    worker = start_worker(tmp_path / "unused", tmp_path / "worker.log", **cache_env(tmp_path, cache))
    try:
        client = worker.client()
        assert [m.id for m in client.models.list().data] == [NAME]
        reply = client.chat.completions.create(**CHAT["openai_input"])
        assert reply.model == NAME and reply.choices[0].message.content
        assert reply.usage.completion_tokens == 4 or reply.choices[0].finish_reason == "stop"
        with worker.http() as http:  # the snapshot's folder is a path detail, never a name
            missing = http.post(
                worker.url("/v2/test-endpoint/openai/v1/chat/completions"),
                json={**CHAT["openai_input"], "model": COMMIT},
            )
        assert missing.status_code == 404, missing.text
        log = worker.log.read_text()
        assert f"from the hub cache snapshot {snapshot}, in place" in log, log[-3000:]
        assert f"model={snapshot} served_as={NAME} " in log, log[-3000:]
    finally:
        stop_worker(worker)
    assert tree(cache) == before  # read-only: nothing written, copied or converted


def test_a_pinned_revision_in_hf_homes_cache_serves_a_job_through_handler_py(baked_model_path, tmp_path) -> None:
    hub = tmp_path / "hf-home" / "hub"
    pinned = "fedcba9876543210fedcba9876543210fedcba98"
    make_cache(hub, baked_model_path, "models--HuggingFaceTB--SmolLM2-135M-Instruct", commit=pinned, main=COMMIT)
    env = cache_env(tmp_path, tmp_path / "no-runpod-cache", MODEL_REVISION=pinned)
    done = run_handler(tmp_path, env, CHAT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["status"] == "COMPLETED" and result["output"][0]["model"] == NAME, done.stdout[-2000:]
    # refs/main names a commit the cache does not hold: only MODEL_REVISION found this snapshot
    main = run_handler(tmp_path, {**env, "MODEL_REVISION": ""}, CHAT)
    assert main.returncode == 2 and "no snapshots/main, nor refs/main naming one" in main.stderr, main.stderr


def test_a_missing_model_stops_the_start_in_one_line_naming_every_path_it_looked_at(tmp_path) -> None:
    env = cache_env(tmp_path, tmp_path / "runpod-cache", MODEL_NAME="some-org/Absent-Model")
    done = run_handler(tmp_path, env, CHAT)
    assert done.returncode == 2, done.stderr[-3000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, done.stderr[-3000:]
    folder = "models--some-org--Absent-Model"
    for place in (
        tmp_path / "base" / "model",
        tmp_path / "runpod-cache" / folder,
        tmp_path / "hf-home" / "hub" / folder,
        tmp_path / "base" / folder,
    ):
        assert str(place) in errors[0], errors[0]
    assert "MODEL_NAME=some-org/Absent-Model" in errors[0]


class RunPodJobs:
    """RunPod's job API for one worker: the first job take hands out `job`, later ones none; results are kept."""

    def __init__(self, job: dict) -> None:
        self.results: list[dict] = []
        self.taken = 0
        queue = [job]
        jobs = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                take = "/job-take" in self.path and queue
                jobs.taken += bool(take)
                body = json.dumps(queue.pop() if "/job-take/" in self.path else [queue.pop()]).encode() if take else b""
                self.send_response(200 if body else 204)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                if "isStream=false" in self.path:
                    jobs.results.append(json.loads(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def env(self) -> dict[str, str]:
        base = f"http://127.0.0.1:{self.server.server_address[1]}"
        return {
            "RUNPOD_WEBHOOK_GET_JOB": f"{base}/job-take/$RUNPOD_POD_ID?gpu=test",
            "RUNPOD_WEBHOOK_POST_OUTPUT": f"{base}/job-done/$RUNPOD_POD_ID/$ID?gpu=test",
            "RUNPOD_WEBHOOK_POST_STREAM": f"{base}/job-stream/$RUNPOD_POD_ID/$ID?gpu=test",
            "RUNPOD_POD_ID": "cache-test",
            "RUNPOD_SKIP_AUTO_SYSTEM_CHECKS": "true",
        }


@pytest.fixture
def runpod_jobs() -> Iterator[RunPodJobs]:
    jobs = RunPodJobs({"id": "job-1", "input": CHAT})
    yield jobs
    jobs.server.shutdown()


def test_on_runpod_the_worker_passes_its_fitness_checks_and_answers_a_job_from_the_model_cache(
    baked_model_path, tmp_path, runpod_jobs
) -> None:
    cache = tmp_path / "runpod-cache"
    make_cache(cache, baked_model_path, "models--HuggingFaceTB--SmolLM2-135M-Instruct")
    env = worker_env(tmp_path / "unused", **cache_env(tmp_path, cache), **runpod_jobs.env())
    with (tmp_path / "worker.log").open("w") as out:
        process = subprocess.Popen(
            [sys.executable, str(ROOT / "handler.py")], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        wait_until(lambda: runpod_jobs.results or process.poll() is not None, "the job's result or an exit")
        log = (tmp_path / "worker.log").read_text()
        assert process.poll() is None and "All fitness checks passed" in log, log[-3000:]
        output = runpod_jobs.results[0]["output"]  # the SDK gives a one-output aggregate as that output
        assert output["model"] == NAME and output["choices"][0]["message"]["content"], output
    finally:
        process.terminate()
        process.wait(timeout=60)


def test_with_verify_model_sha256_a_corrupted_cache_blob_fails_the_fitness_check_before_a_job_is_taken(
    baked_model_path, tmp_path, runpod_jobs
) -> None:
    cache = tmp_path / "runpod-cache"
    snapshot = make_cache(cache, baked_model_path, "models--HuggingFaceTB--SmolLM2-135M-Instruct")
    blob = snapshot.parents[1] / "blobs" / Path(os.readlink(snapshot / "model.safetensors")).name
    blob.unlink()
    shutil.copyfile(baked_model_path / "model.safetensors", blob)  # a blob of its own, to corrupt
    with blob.open("r+b") as f:  # the last bytes are tensor data: the weights still load, their sum differs
        f.seek(-64, 2)
        f.write(bytes(64))
    assert model_files_mismatch(str(snapshot)) == []  # by default: the link resolves, no byte is read
    assert model_files_mismatch(str(snapshot), sha256=True) == ["model.safetensors"]
    env = worker_env(tmp_path / "unused", **cache_env(tmp_path, cache), **runpod_jobs.env(), VERIFY_MODEL_SHA256="true")
    log = tmp_path / "worker.log"
    with log.open("w") as out:
        code = subprocess.run(
            [sys.executable, str(ROOT / "handler.py")],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=600,
        ).returncode  # a guard against a hung worker
    assert code == 1 and "model_files_match_manifest" in log.read_text(), log.read_text()[-3000:]
    assert runpod_jobs.results == [] and runpod_jobs.taken == 0
