"""Faults a serverless worker meets: clients that leave during prefill, RunPod's /cancel of a running job,
and a KV pool too small for the offered load; each must free its pages and leave the others served."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from local_worker import start_worker, stop_worker
from waiting import HANG_S, wait_until


def _engine(http: httpx.Client) -> dict:
    return http.get("/health").json()["engine"]


def _wait_all_free(http: httpx.Client) -> dict:
    return wait_until(lambda: (e := _engine(http))["kv_pages_free"] == e["kv_pages"] and e, "every page free")


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_gone_during_prefill_frees_its_pages(worker, http, model_name, stream) -> None:
    long_prompt = "Summarise this. " + "The quick brown fox jumps over the lazy dog. " * 170  # about 1,900 tokens
    body = {"model": model_name, "prompt": long_prompt, "max_tokens": 100, "stream": stream}
    with httpx.Client(base_url=worker.base, timeout=httpx.Timeout(30, read=0.15)) as own:
        with pytest.raises(httpx.ReadTimeout):  # gone before the first token: the prompt is still being computed
            with own.stream("POST", "/openai/v1/completions", json=body) as reply:
                reply.read()
    engine = _wait_all_free(http)
    assert engine["kv_pages_free"] == engine["kv_pages"]
    assert http.get("/health").json()["jobs"]["inProgress"] == 0


def test_runpod_cancel_of_a_running_job_frees_its_pages(http, model_name) -> None:
    body = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    job = http.post("/v2/e/run", json={"input": {"openai_route": "/v1/completions", "openai_input": body}}).json()
    wait_until(lambda: http.post(f"/v2/e/stream/{job['id']}").json()["stream"], "the job's first output")
    assert _engine(http)["kv_pages_free"] < _engine(http)["kv_pages"]  # it is decoding
    assert http.post(f"/v2/e/cancel/{job['id']}").json()["status"] == "CANCELLED"
    assert http.get(f"/v2/e/status/{job['id']}").json()["status"] == "CANCELLED"
    engine = _wait_all_free(http)
    assert engine["kv_pages_free"] == engine["kv_pages"]


def test_a_pool_too_small_for_the_load_preempts_and_every_request_finishes(
    baked_model_path, tmp_path, model_name
) -> None:
    # 24 pages of 16 tokens: each request (about 8 prompt + 60 generated tokens, 5 pages) fits alone; eight do not.
    worker = start_worker(baked_model_path, tmp_path / "worker.log", NUM_GPU_BLOCKS_OVERRIDE="24", MAX_MODEL_LEN="384")
    try:

        def ask(client: openai.OpenAI, topic: str) -> str:
            answer = client.completions.create(
                model=model_name,
                prompt=f"A few words about {topic}:",
                max_tokens=60,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            return answer.choices[0].text

        topics = ["cats", "rain", "bread", "trains", "bees", "glass", "winter", "music"]
        # No deadline but HANG_S's: what the test asserts is that every request ends with its solo answer and that
        # the pool really ran short (preemptions), not how long recomputing took on this machine.
        client = worker.client(timeout=HANG_S)
        solo = {topic: ask(client, topic) for topic in topics[:2]}
        with ThreadPoolExecutor(len(topics)) as pool:
            together = dict(zip(topics, pool.map(lambda t: ask(client, t), topics), strict=True))
        with worker.http() as http:
            engine = _wait_all_free(http)
        assert engine["preemptions"] > 0, engine  # the pool really was too small
        assert all(together[t] == solo[t] for t in solo) and all(len(v) > 0 for v in together.values())
        assert engine["kv_pages_free"] == engine["kv_pages"]
    finally:
        stop_worker(worker)
