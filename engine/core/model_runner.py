"""Runs one scheduled step: flattened inputs and the CSR page table, the model forward, logits, sampling.

Logits are computed only for the rows that need them: the last row of each sequence that reaches the
end of its known tokens, and the prompt rows of requests that asked for prompt_logprobs. An embedding request
(engine/core/output/pooling.py) gets no logits: its chunk's final hidden states are handed on as they are.

Each KV layer group has its own page pool and backend (planned once per step with the group's metadata); the
groups' page lists are equally long, so they share qo/kv indptr and last page lengths and differ in pages only. A
hybrid model's recurrent layers read and write their state slots (engine/core/kv/state_cache.py) under one
RecurrentStep plan per step.

A vision model's images are encoded in the step that prefills their spans (engine/core/images/intake.py), every image of
the step in one batched tower call; their embeddings replace the spans' rows of the token embeddings, and the
spans go to the backends as bidirectional blocks (AttentionMetadata.bidirectional). A causal model's span may be
split across chunks: its encoding waits on the span until the last of it is prefilled. Images with 3-D positions
(Qwen-VL) shift their sequence's positions (engine/core/images/positions.py); the other ranks get rows and embeddings.
"""

from __future__ import annotations

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.core.images.intake import ImageSpan
from engine.core.images.positions import StepPositions
from engine.core.kv.cache import PagePool
from engine.core.kv.state_cache import StatePool
from engine.core.scheduling.sequence import Sequence, SequenceGroup
from engine.core.scheduling.step import Sample, ScheduledSeq, SchedulerOutput, StepResult, sampling_row
from engine.core.spec.verify import verify
from engine.model.kv_spec import KVGroupSpec
from engine.model.layers.recurrent_step import RecurrentPlan, RecurrentSpec, RecurrentStep
from engine.sample.logits_processor import SamplingRow, process_logits
from engine.sample.sampler import Sampler, compute_logprobs

# Prompt-logprob rows are turned into [rows, vocab] logits this many at a time, to bound memory.
PROMPT_LOGPROB_SLICE = 256


class ModelRunner:
    """Owns the model, the page pools and the attention backends (one per KV layer group); execute() runs one step."""

    def __init__(
        self,
        model: torch.nn.Module,
        groups: list[KVGroupSpec],
        pools: list[PagePool],
        backends: list[AttentionBackend],
        sampler: Sampler,
        device: torch.device,
        recurrent: RecurrentSpec | None = None,
        state_pool: StatePool | None = None,
    ) -> None:
        self.model, self.pools, self.backends, self.sampler, self.device = model, pools, backends, sampler, device
        self.page_size = pools[0].page_size
        self.state_pool = state_pool
        self.recurrent_plan = RecurrentPlan() if state_pool is not None else None
        if len(groups) == 1 and not groups[0].readers and recurrent is None:
            self.layer_caches, self.layer_backends = pools[0].kv_caches, backends[0]
        else:
            where = {layer: (g, i) for g, spec in enumerate(groups) for i, layer in enumerate(spec.layers)}
            # A layer that shares KV attends over its source's pages with its source's backend.
            where.update({reader: where[source] for spec in groups for reader, source in spec.readers})
            caches = {n: pools[g].kv_caches[i] for n, (g, i) in where.items()}
            layer_backends = {n: backends[g] for n, (g, _) in where.items()}
            if recurrent is not None:
                # A recurrent layer's "cache" is its (conv windows, delta states) slots; its "backend" the step plan.
                caches.update(zip(recurrent.layers, state_pool.layer_states, strict=True))
                layer_backends.update((n, self.recurrent_plan) for n in recurrent.layers)
            self.layer_caches = [caches[n] for n in range(len(caches))]
            self.layer_backends = [layer_backends[n] for n in range(len(caches))]
        self.num_tokens_run = 0  # tokens fed to the model over the runner's life (prefix hits are not)
        self.num_images_encoded = 0  # images through the vision tower over the runner's life
        vision = model.vision_spec() if hasattr(model, "vision_spec") else None
        # Per KV group: do an image's tokens see each other both ways there (Gemma 4: on the windowed layers only)
        self.bidirectional = [vision is not None and vision.bidirectional_in(g.window) for g in groups]
        self.graph_runner = None  # CUDA: engine.core.cuda_graphs.CudaGraphRunner for decode steps
        self.keep_hidden = False  # hand every row's final hidden state on (an MTP head reads them)
        # Tensor parallelism (engine.core.distributed.ranks.RankSet): the other ranks get each step's inputs and
        # every logits call's rows, and run their shards alongside this one.
        self.peers = None

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        for g, pool in enumerate(self.pools):
            pool.copy_pages([s for h, s, _ in out.copies if h == g], [d for h, _, d in out.copies if h == g])
        input_ids, positions, metas, sample_at, prompt_at, pool_at, images = self._prepare(out.scheduled)
        recurrent = None if self.state_pool is None else self._recurrent_step(out.scheduled, metas[0].is_decode)
        extra = {} if images is None else {"image_embeds": self._encode_images(*images)}  # (the other ranks' too)
        if self.peers is not None:
            self.peers.send_step(out, input_ids, positions, metas, recurrent, self.model.lora, **extra)
        if recurrent is not None:
            self.state_pool.copy_slots(out.state_copies)
            self.recurrent_plan.plan(recurrent)
        if self.graph_runner is not None and images is None:  # (a step with images is a prefill: eager)
            # NOTE: a replayed hidden is a static buffer the next replay overwrites: logits come first.
            hidden = self.graph_runner(input_ids, positions, metas[0], self.recurrent_plan and self.recurrent_plan.step)
        else:
            for backend, meta in zip(self.backends, metas, strict=True):
                backend.plan(meta)
            hidden = self.model(input_ids, positions, metas[0], self.layer_caches, self.layer_backends, **extra)
        self.num_tokens_run += input_ids.numel()
        result = StepResult(
            aux_hidden=getattr(self.model, "aux_hidden", None), hidden=hidden if self.keep_hidden else None
        )
        for i, row, count in pool_at:
            result.pooled[i] = hidden[row : row + count]
        if prompt_at:
            self._prompt_logprobs(hidden, out.scheduled, prompt_at, result)
        verify_at = [(i, row, out.scheduled[i].num_tokens) for i, row in sample_at if out.scheduled[i].draft]
        sample_at = [(i, row) for i, row in sample_at if not out.scheduled[i].draft]
        if sample_at or verify_at:
            # A speculating sequence needs every one of its rows: each verifies the proposal before it.
            picked = sample_at + [(i, r) for i, row, n in verify_at for r in range(row, row + n)]
            rows = torch.tensor([row for _, row in picked], device=self.device)
            # Greedy rows get the float32 argmax of a bf16 head (engine.model.layers.logits); sampled rows do
            # not need it, and at batch 64 it would cost a few percent of the step.
            greedy = [j for j, (i, _) in enumerate(picked) if out.scheduled[i].group.params.greedy]
            logits = self._logits(
                hidden.index_select(0, rows), torch.tensor(greedy, dtype=torch.long, device=self.device)
            )
            if sample_at:
                self._sample(logits[: len(sample_at)], [(i, out.scheduled[i]) for i, _ in sample_at], result)
            if verify_at:
                verify(logits[len(sample_at) :], [(i, out.scheduled[i]) for i, *_ in verify_at], self.sampler, result)
        return result

    def _logits(self, hidden: torch.Tensor, exact_rows: torch.Tensor | None = None) -> torch.Tensor:
        if self.peers is not None:
            self.peers.send_logits(hidden, exact_rows)
        return self.model.compute_logits(hidden, exact_rows)

    def _prepare(self, scheduled: list[ScheduledSeq]):
        """The step's flattened tokens and page tables (one per group), built in Python lists and turned into
        tensors once."""
        ps = self.page_size
        ids: list[int] = []
        lora_runs: list[tuple[int | None, int]] = []  # (adapter slot, rows) in row order
        positions = StepPositions()
        groups = range(len(self.pools))
        slots: list[list[int]] = [[] for _ in groups]
        indices: list[list[int]] = [[] for _ in groups]
        qo, kv, last = [0], [0], []
        sample_at: list[tuple[int, int]] = []  # (scheduled index, hidden row)
        prompt_at: list[tuple[int, int, int]] = []  # (scheduled index, first hidden row, number of rows)
        pool_at: list[tuple[int, int, int]] = []  # the same, for embedding requests
        spans: list[list[tuple[int, int]]] = []  # per request, the image spans its chunk prefills
        encode: list[tuple[ImageSpan, int, int, int]] = []  # (span, first hidden row, first soft token, count)
        for i, s in enumerate(scheduled):
            seq, start, end = s.seq, s.start, s.start + s.num_tokens
            num_pages = -(-end // ps)
            for g, pages in enumerate(seq.kv_pages):
                pages = pages if len(pages) == num_pages else pages[:num_pages]
                slots[g] += [pages[p // ps] * ps + p % ps for p in range(start, end)]
                indices[g] += pages
            row = qo[-1]
            ids += seq.token_ids[start:end] if not s.draft else seq.token_ids[start : end - len(s.draft)] + s.draft
            positions.add(s.group.images, start, end)
            qo.append(row + s.num_tokens)
            lora_runs.append((s.group.adapter, s.num_tokens))
            mine = [span for span in s.group.images if span.start < end and span.end > start] if not s.draft else []
            spans.append([(span.start, span.end) for span in mine])
            for span in mine:
                lo, hi = max(span.start, start), min(span.end, end)
                encode.append((span, row + lo - start, lo - span.start, hi - lo))
            kv.append(kv[-1] + num_pages)
            last.append(end - (num_pages - 1) * ps)
            if s.group.pools:
                pool_at.append((i, row, s.num_tokens))
            elif s.draft:
                sample_at.append((i, row))  # its first row: the runner verifies the proposals on it and after
            elif end == seq.num_tokens:
                sample_at.append((i, row + s.num_tokens - 1))
            prompt_len = len(s.group.prompt_token_ids)
            if s.group.needs_prompt_logprobs and start < prompt_len - 1 and seq is s.group.seqs[0]:
                prompt_at.append((i, row, min(end, prompt_len - 1) - start))
        dev = self.device
        if self.model.lora is not None:
            self.model.lora.plan.update(lora_runs, dev)
        i32 = torch.int32
        qo_indptr = torch.tensor(qo, dtype=i32).to(dev, non_blocking=True)
        kv_indptr = torch.tensor(kv, dtype=i32).to(dev, non_blocking=True)
        last_len = torch.tensor(last, dtype=i32).to(dev, non_blocking=True)
        metas = [
            AttentionMetadata(
                qo_indptr=qo_indptr,
                kv_indptr=kv_indptr,
                kv_indices=torch.tensor(indices[g], dtype=i32).to(dev, non_blocking=True),
                kv_last_page_len=last_len,
                slot_mapping=torch.tensor(slots[g], dtype=torch.int64).to(dev, non_blocking=True),
                page_size=ps,
                is_decode=len(ids) == len(scheduled),
                bidirectional=spans if encode and self.bidirectional[g] else None,
            )
            for g in groups
        ]
        input_ids = torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True)
        return input_ids, positions.tensor(dev), metas, sample_at, prompt_at, pool_at, (encode,) if encode else None

    def _encode_images(self, encode: list[tuple[ImageSpan, int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, embeddings) of the step's image soft tokens: each image not yet encoded through the tower once."""
        todo = [span for span in {id(span): span for span, *_ in encode}.values() if span.encoded is None]
        if todo:
            embeds = self.model.encode_images(
                [span.pixels.to(self.device) for span in todo], [span.grid for span in todo]
            )  # each [tokens, width]
            for span, embed in zip(todo, embeds, strict=True):
                span.encoded = embed
            self.num_images_encoded += len(todo)
        rows = torch.cat([torch.arange(row, row + n) for _, row, _, n in encode]).to(self.device)
        values = torch.cat([span.encoded[first : first + n] for span, _, first, n in encode])
        for span, _, first, n in encode:
            if first + n == span.end - span.start:  # its last tokens: the encoding is not needed again
                span.encoded = None
        return rows, values

    def _recurrent_step(self, scheduled: list[ScheduledSeq], is_decode: bool) -> RecurrentStep:
        spans, slots, captures, row = [], [], [], 0
        for i, s in enumerate(scheduled):
            spans.append((row, s.num_tokens))
            slots.append(s.seq.state_slot)
            if s.seq.state_capture is not None:
                boundary, slot = s.seq.state_capture
                captures.append((i, boundary - s.start, slot))
            row += s.num_tokens
        verify = frozenset(i for i, s in enumerate(scheduled) if s.draft)
        return RecurrentStep(
            spans=spans,
            slots=slots,
            captures=captures,
            slot_index=torch.tensor(slots, device=self.device),
            is_decode=is_decode,
            verify=verify,
        )

    @torch.inference_mode()
    def settle(self, out: SchedulerOutput) -> None:
        """After the scheduler committed a step: each speculating sequence's recurrent state advances by the rows it
        kept (engine/model/layers/recurrent_step.py), before any later step, fork or snapshot copy reads it."""
        if self.recurrent_plan is not None:
            kept = {i: s.seq.num_computed_tokens - s.start for i, s in enumerate(out.scheduled) if s.draft}
            if self.peers is not None and kept:
                self.peers.send_settle(kept)
            self.recurrent_plan.settle(kept)

    def _prompt_logprobs(
        self,
        hidden: torch.Tensor,
        scheduled: list[ScheduledSeq],
        prompt_at: list[tuple[int, int, int]],
        result: StepResult,
    ) -> None:
        for i, row, count in prompt_at:
            s = scheduled[i]
            k = s.group.params.prompt_logprobs or 0
            targets = s.group.prompt_token_ids[s.start + 1 : s.start + 1 + count]
            entries: list[tuple[float, list[tuple[int, float]]]] = []
            for lo in range(0, count, PROMPT_LOGPROB_SLICE):
                hi = min(count, lo + PROMPT_LOGPROB_SLICE)
                logits = self._logits(hidden[row + lo : row + hi])
                entries += compute_logprobs(logits, targets[lo:hi], k)
            result.prompt_logprobs[i] = entries

    def _sample(self, logits: torch.Tensor, items: list[tuple[int, ScheduledSeq]], result: StepResult) -> None:
        """items[j] owns logits row j. Beams get their candidates, everything else one sampler call."""
        rows: list[SamplingRow] = []
        owners: list[int] = []  # logits row of each sampling row
        for j, (_, s) in enumerate(items):
            group = s.group
            if group.beam is not None:
                continue
            # A group's first token is drawn once per choice, from the prompt's one logits row.
            seqs = group.seqs if not group.forked else [s.seq]
            rows += [self._row(group, seq) for seq in seqs]
            owners += [j] * len(seqs)
        if rows:
            index = torch.tensor(owners, device=logits.device)
            try:
                self._draw(logits.index_select(0, index), rows, owners, items, result)
            except Exception:
                # One request's bad parameters must not fail the batch: retry each sequence alone.
                for j, (i, _) in enumerate(items):
                    mine = [r for r, o in zip(rows, owners, strict=True) if o == j]
                    if not mine:
                        continue
                    try:
                        self._draw(logits[j : j + 1].expand(len(mine), -1), mine, [j] * len(mine), items, result)
                    except Exception as exc:
                        result.errors[i] = exc
        for j, (i, s) in enumerate(items):
            if s.group.beam is not None:
                try:
                    result.samples[i] = self._beam_candidates(logits[j : j + 1], s)
                except Exception as exc:
                    result.errors[i] = exc

    def _draw(
        self,
        logits: torch.Tensor,
        rows: list[SamplingRow],
        owners: list[int],
        items: list[tuple[int, ScheduledSeq]],
        result: StepResult,
    ) -> None:
        out = self.sampler(logits, rows)
        tops = out.top_logprobs
        samples: dict[int, list[Sample]] = {}
        for r, j in enumerate(owners):
            top = tops[r] if tops is not None and rows[r].params.logprobs is not None else None
            samples.setdefault(items[j][0], []).append(Sample(out.token_ids[r], out.logprobs[r], top))
        result.samples.update(samples)

    def _beam_candidates(self, logits: torch.Tensor, s: ScheduledSeq) -> list[Sample]:
        """The 2*width best next tokens of one beam, by logprob after masks and penalties."""
        row = self._row(s.group, s.seq)
        logprobs = torch.log_softmax(process_logits(logits, [row]), dim=-1)[0]
        values, ids = logprobs.topk(min(2 * s.group.beam.width, logprobs.numel()))
        # A grammar can leave fewer allowed tokens than candidates asked for: masked ones never extend a beam.
        return [Sample(t, lp) for t, lp in zip(ids.tolist(), values.tolist(), strict=True) if lp != float("-inf")]

    @staticmethod
    def _row(group: SequenceGroup, seq: Sequence) -> SamplingRow:
        return sampling_row(group, seq)
