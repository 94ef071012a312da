"""The `priority` request field (vLLM's) reaches the engine from every door: chat and completions (body or
extra_body), Responses and Messages (extra_body), native sampling_params; a bad value is a 400 naming it, and
SCHEDULING_POLICY is checked at start. Ordering itself: tests/engine/core/test_priority_scheduling.py."""

from __future__ import annotations

import anthropic
import openai
import pytest
from local_worker import ENDPOINT

from worker.openai.params import native_sampling_params, openai_sampling_params
from worker.openai.protocol import ChatCompletionRequest, CompletionRequest
from worker.settings import SettingsError, load_settings


def test_priority_reaches_the_sampling_params() -> None:
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}], priority=-3)
    assert openai_sampling_params(chat, 2048).priority == -3
    completion = CompletionRequest(model="m", prompt="Hi")
    assert openai_sampling_params(completion, 2048).priority == 0
    assert native_sampling_params({"priority": 7, "max_tokens": 2}, 2048).priority == 7


def test_scheduling_policy_is_checked_at_start() -> None:
    assert load_settings({}).scheduling_policy == "fcfs"
    assert load_settings({"SCHEDULING_POLICY": "priority"}).scheduling_policy == "priority"
    with pytest.raises(SettingsError, match="SCHEDULING_POLICY"):
        load_settings({"SCHEDULING_POLICY": "lifo"})


def test_every_door_takes_priority(client, model_name, worker) -> None:
    extra = {"priority": 2}
    chat = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2, extra_body=extra)
    assert chat.choices[0].finish_reason in ("length", "stop")
    assert client.completions.create(model=model_name, prompt="Hi", max_tokens=2, extra_body=extra).choices
    assert client.responses.create(model=model_name, input="Hi", max_output_tokens=2, store=False,
                                   extra_body=extra).status in ("completed", "incomplete")
    claude = anthropic.Anthropic(base_url=worker.url(f"{ENDPOINT}/openai"), api_key=worker.api_key, max_retries=0)
    message = claude.messages.create(model=model_name, max_tokens=2, messages=[{"role": "user", "content": "Hi"}],
                                     extra_body=extra)
    assert message.stop_reason in ("max_tokens", "end_turn")


def test_a_bad_priority_is_a_400_naming_it(client, model_name) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                       max_tokens=2, extra_body={"priority": "high"})
    assert caught.value.body["param"] == "priority"
    assert client.models.list().data  # and the worker goes on serving
