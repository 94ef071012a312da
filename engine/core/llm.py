"""Offline batch generation on the engine, like vLLM's LLM(...).generate(prompts, sampling_params)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.core.engine import LLMEngine
from engine.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from engine.sample.params import SamplingParams


@dataclass(kw_only=True)
class FinalOutput:
    """One prompt's finished result: its choices, whole."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0

    @property
    def text(self) -> list[str]:
        return [o.text for o in self.outputs]

    @property
    def token_ids(self) -> list[list[int]]:
        return [o.token_ids for o in self.outputs]


class LLM:
    """LLM(model_path, **EngineConfig fields); generate() runs every prompt to the end and returns in order."""

    def __init__(self, model_path: str, **config: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model_path=model_path, **config))
        self.tokenizer = self.engine.tokenizer
        self._ids = 0

    def generate(
        self,
        prompts: list[str] | list[list[int]] | str,
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[FinalOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or SamplingParams()
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts")
        results: dict[str, FinalOutput] = {}
        order = []
        for prompt, p in zip(prompts, per_prompt, strict=True):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            request_id = f"llm-{self._ids}"
            self._ids += 1
            self.engine.add_request(request_id, ids, p)
            order.append(request_id)
        while self.engine.has_unfinished():
            for output in self.engine.step():
                self._merge(results, output)
            failures = self.engine.pop_failures()
            if failures:
                for request_id in order:
                    self.engine.abort(request_id)
                raise failures[0][1]
        return [results[r] for r in order]

    @staticmethod
    def _merge(results: dict[str, FinalOutput], output: RequestOutput) -> None:
        final = results.get(output.request_id)
        if final is None:
            final = results[output.request_id] = FinalOutput(
                request_id=output.request_id, prompt_token_ids=output.prompt_token_ids, outputs=[]
            )
        if output.prompt_logprobs is not None:
            final.prompt_logprobs = output.prompt_logprobs
        final.num_cached_tokens = output.num_cached_tokens
        for delta in output.outputs:
            while len(final.outputs) <= delta.index:
                final.outputs.append(CompletionOutput(index=len(final.outputs)))
            final.outputs[delta.index].add(delta)
