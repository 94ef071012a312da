"""The Responses API tests' one call: a response through the official client, validated against OpenAI's spec."""

from __future__ import annotations

import openai
from openai_schema import validate

Q = "What is the capital of France?"


def respond(client: openai.OpenAI, model: str, input=Q, **kw):
    kw.setdefault("max_output_tokens", 12)
    kw.setdefault("temperature", 0)
    response = client.responses.create(model=model, input=input, **kw)
    validate(response)
    return response
