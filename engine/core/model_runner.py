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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.core.cuda_graphs import CudaGraphRunner, prepare_cuda
from engine.core.images.intake import ImageSpan
from engine.core.images.positions import StepPositions
from engine.core.kv.cache import PagePool
from engine.core.kv.state_cache import StatePool
from engine.core.scheduling.sequence import Sequence, SequenceGroup
from engine.core.scheduling.step import Sample, ScheduledSeq, SchedulerOutput, StepResult, sampling_row
from engine.core.spec.verify import verify
from engine.model.kv_spec import KVGroupSpec
from engine.model.layers.lora import LoraSet
from engine.model.layers.recurrent_step import RecurrentPlan, RecurrentSpec, RecurrentStep
from engine.sample.logits_processor import SamplingRow, process_logits
from engine.sample.sampler import Sampler, compute_logprobs

if TYPE_CHECKING:
    from engine.model.models import CausalLM
    from engine.model.vision.spec import VisionSpec

# Prompt-logprob rows are turned into [rows, vocab] logits this many at a time, to bound memory.
PROMPT_LOGPROB_SLICE = 256


class Peers(Protocol):
    """The other tensor-parallel ranks as the runner drives them (engine.core.distributed.ranks.RankSet): they get
    each step's inputs, every logits call's rows and each settle, and run their shards alongside this one."""

    def send_step(
        self,
        out: SchedulerOutput,
        *,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metas: list[AttentionMetadata],
        recurrent: RecurrentStep | None,
        lora: LoraSet | None,
        image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None: ...

    def send_logits(self, hidden: torch.Tensor, exact_rows: torch.Tensor | None) -> None: ...

    def send_settle(self, accepted: dict[int, int]) -> None: ...


class VisionModel(Protocol):
    """What the runner asks of a model with a vision tower (Gemma 3 and 4, Qwen-VL), beyond CausalLM: module
    methods that torch's typing sees as `Tensor | Module` attributes."""

    def vision_spec(self) -> VisionSpec: ...

    def encode_images(self, pixels: list[torch.Tensor], grids: list[Any]) -> list[torch.Tensor]: ...


@dataclass(kw_only=True)
class StepInputs:
    """One step's model inputs, built once by ModelRunner._prepare, and the hidden rows each result is read from."""

    input_ids: torch.Tensor  # [tokens]
    positions: torch.Tensor  # [tokens], or [3, tokens] when the step has 3-D (Qwen-VL) image positions
    metas: list[AttentionMetadata]  # one per KV layer group: the same rows, each group's own pages
    sample_rows: list[tuple[int, int]]  # (scheduled index, hidden row) of each sequence sampled or verified
    prompt_rows: list[tuple[int, int, int]]  # (scheduled index, first hidden row, rows) of prompt logprobs
    pooled_rows: list[tuple[int, int, int]]  # the same, of embedding requests' chunks
    image_rows: list[tuple[ImageSpan, int, int, int]]  # (span, first hidden row, first soft token, count)
    # Each row's text of a pair (BERT's token_type_ids), for a model that reads them (None: it does not)
    token_type_ids: torch.Tensor | None = None


class ModelRunner:
    """Owns the model, the page pools and the attention backends (one per KV layer group); execute() runs one step.

    Its collaborators come in at construction: `peers`, the other tensor-parallel ranks (None on one rank), and
    `keep_hidden`, whether each step hands every row's final hidden state on (an MTP head reads them). Its decode
    CUDA graphs are its own, captured by capture_graphs() once the engine has said why graphs may be off: capturing
    replays the model over the runner's own per-layer caches and backends, so it can only follow construction.
    """

    def __init__(
        self,
        *,
        model: torch.nn.Module,
        groups: list[KVGroupSpec],
        pools: list[PagePool],
        backends: list[AttentionBackend],
        sampler: Sampler,
        device: torch.device,
        recurrent: RecurrentSpec | None = None,
        state_pool: StatePool | None = None,
        peers: Peers | None = None,
        keep_hidden: bool = False,
    ) -> None:
        self.model = model
        self.pools = pools
        self.backends = backends
        self.sampler = sampler
        self.device = device
        self.page_size = pools[0].page_size
        self.state_pool = state_pool
        self.recurrent_plan = RecurrentPlan() if state_pool is not None else None
        # One group's pools and backend serve every layer as they are; otherwise, one cache and backend per layer.
        self.layer_caches: list[tuple[torch.Tensor, torch.Tensor]]
        self.layer_backends: AttentionBackend | list[AttentionBackend | RecurrentPlan]
        if len(groups) == 1 and not groups[0].readers and recurrent is None:
            self.layer_caches = pools[0].kv_caches
            self.layer_backends = backends[0]
        else:
            where = {
                layer: (group_index, slot)
                for group_index, spec in enumerate(groups)
                for slot, layer in enumerate(spec.layers)
            }
            # A layer that shares KV attends over its source's pages with its source's backend.
            where.update({reader: where[source] for spec in groups for reader, source in spec.readers})
            caches = {layer: pools[group_index].kv_caches[slot] for layer, (group_index, slot) in where.items()}
            layer_backends: dict[int, AttentionBackend | RecurrentPlan] = {
                layer: backends[group_index] for layer, (group_index, _) in where.items()
            }
            if recurrent is not None:
                assert state_pool is not None and self.recurrent_plan is not None, "a recurrent model has a state pool"
                # A recurrent layer's "cache" is its (conv windows, delta states) slots; its "backend" the step plan.
                caches.update(zip(recurrent.layers, state_pool.layer_states, strict=True))
                layer_backends.update((layer, self.recurrent_plan) for layer in recurrent.layers)
            self.layer_caches = [caches[layer] for layer in range(len(caches))]
            self.layer_backends = [layer_backends[layer] for layer in range(len(caches))]
        self.num_tokens_run = 0  # tokens fed to the model over the runner's life (prefix hits are not)
        self.num_images_encoded = 0  # images through the vision tower over the runner's life
        vision = cast(VisionModel, model).vision_spec() if hasattr(model, "vision_spec") else None
        # Per KV group: do an image's tokens see each other both ways there (Gemma 4: on the windowed layers only)
        self.bidirectional = [vision is not None and vision.bidirectional_in(group.window) for group in groups]
        self.peers = peers
        self.keep_hidden = keep_hidden
        self.reads_token_types = bool(getattr(model, "reads_token_types", False))  # BERT: a pair's segments
        self.graph_runner: CudaGraphRunner | None = None  # set by capture_graphs (CUDA): decode steps replay

    def capture_graphs(self, *, max_num_seqs: int, max_model_len: int, enforce_eager: bool, why: str | None) -> None:
        """CUDA only, once, before any request holds pages: warms the kernels up and captures decode graphs over this
        runner's caches, unless enforce_eager (why: the reason it is set, for the start-up log)."""
        hybrid = self.state_pool is not None  # its graphs take every layer's caches and backend (state slots too)
        layer_backends = self.layer_backends if hybrid else None
        assert layer_backends is None or isinstance(layer_backends, list), "a hybrid model has a backend per layer"
        self.graph_runner = prepare_cuda(
            self.model,
            self.backends[0],
            self.layer_caches if hybrid else self.pools[0].kv_caches,
            page_size=self.page_size,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            why=why,
            layer_backends=layer_backends,
            state_pool=self.state_pool,
        )

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        for group_index, pool in enumerate(self.pools):
            copies = [(source, dest) for kv_group, source, dest in out.copies if kv_group == group_index]
            pool.copy_pages([source for source, _ in copies], [dest for _, dest in copies])
        inputs = self._prepare(out.scheduled)
        hidden = self._forward(out, inputs)
        self.num_tokens_run += inputs.input_ids.numel()
        result = StepResult(
            aux_hidden=getattr(self.model, "aux_hidden", None), hidden=hidden if self.keep_hidden else None
        )
        for index, row, count in inputs.pooled_rows:
            result.pooled[index] = hidden[row : row + count]
        if inputs.prompt_rows:
            self._prompt_logprobs(hidden, out.scheduled, inputs.prompt_rows, result)
        if inputs.sample_rows:
            self._sample_or_verify(hidden, out.scheduled, inputs.sample_rows, result)
        return result

    def _forward(self, out: SchedulerOutput, inputs: StepInputs) -> torch.Tensor:
        """The step's final hidden states [tokens, hidden_size]: a replayed decode graph, or the model run eagerly."""
        metas = inputs.metas
        recurrent = None if self.state_pool is None else self._recurrent_step(out.scheduled, metas[0].is_decode)
        # (the other ranks get the image embeddings too)
        embeds = self._encode_images(inputs.image_rows) if inputs.image_rows else None
        extra: dict[str, Any] = {"image_embeds": embeds} if embeds is not None else {}
        if inputs.token_type_ids is not None:
            extra["token_type_ids"] = inputs.token_type_ids
        if self.peers is not None:
            self.peers.send_step(
                out,
                input_ids=inputs.input_ids,
                positions=inputs.positions,
                metas=metas,
                recurrent=recurrent,
                lora=cast("LoraSet | None", self.model.lora),
                **extra,
            )
        if recurrent is not None:
            assert self.state_pool is not None and self.recurrent_plan is not None, "a recurrent step has its pool"
            self.state_pool.copy_slots(out.state_copies)
            self.recurrent_plan.plan(recurrent)
        if self.graph_runner is not None and not inputs.image_rows:  # (a step with images is a prefill: eager)
            # NOTE: a replayed hidden is a static buffer the next replay overwrites: logits come first.
            recurrent_step = self.recurrent_plan.step if self.recurrent_plan is not None else None
            return self.graph_runner(inputs.input_ids, inputs.positions, metas[0], recurrent_step)
        for backend, meta in zip(self.backends, metas, strict=True):
            backend.plan(meta)
        return self.model(inputs.input_ids, inputs.positions, metas[0], self.layer_caches, self.layer_backends, **extra)

    def _sample_or_verify(
        self,
        hidden: torch.Tensor,
        scheduled: list[ScheduledSeq],
        sample_rows: list[tuple[int, int]],
        result: StepResult,
    ) -> None:
        """One logits call for every sampled row and every row of a speculating sequence; then the sampler or the
        verifier on each."""
        verify_at = [(index, row, scheduled[index].num_tokens) for index, row in sample_rows if scheduled[index].draft]
        sample_at = [(index, row) for index, row in sample_rows if not scheduled[index].draft]
        # A speculating sequence needs every one of its rows: each verifies the proposal before it.
        picked = sample_at + [
            (index, verify_row) for index, row, count in verify_at for verify_row in range(row, row + count)
        ]
        hidden_rows = torch.tensor([row for _, row in picked], device=self.device)
        # Greedy rows get the float32 argmax of a bf16 head (engine.model.layers.logits); sampled rows do
        # not need it, and at batch 64 it would cost a few percent of the step.
        greedy = [logits_row for logits_row, (index, _) in enumerate(picked) if scheduled[index].group.sampling.greedy]
        logits = self._logits(
            hidden.index_select(0, hidden_rows), torch.tensor(greedy, dtype=torch.long, device=self.device)
        )
        if sample_at:
            self._sample(logits[: len(sample_at)], [(index, scheduled[index]) for index, _ in sample_at], result)
        if verify_at:
            verify(
                logits[len(sample_at) :], [(index, scheduled[index]) for index, *_ in verify_at], self.sampler, result
            )

    def _logits(self, hidden: torch.Tensor, exact_rows: torch.Tensor | None = None) -> torch.Tensor:
        if self.peers is not None:
            self.peers.send_logits(hidden, exact_rows)
        return cast("CausalLM", self.model).compute_logits(hidden, exact_rows)

    def _prepare(self, scheduled: list[ScheduledSeq]) -> StepInputs:
        """The step's flattened tokens and page tables (one per group), built in Python lists and turned into
        tensors once."""
        page_size = self.page_size
        token_ids: list[int] = []
        lora_runs: list[tuple[int | None, int]] = []  # (adapter slot, rows) in row order
        positions = StepPositions()
        kv_groups = range(len(self.pools))
        slots: list[list[int]] = [[] for _ in kv_groups]  # per group, each row's K/V slot in the pool
        page_indices: list[list[int]] = [[] for _ in kv_groups]  # per group, each sequence's pages in turn
        qo_offsets = [0]  # each sequence's first row (and the end of the last): FlashInfer's qo_indptr
        kv_offsets = [0]  # each sequence's first page in page_indices: kv_indptr
        last_page_lens: list[int] = []  # tokens in each sequence's last page: kv_last_page_len
        sample_rows: list[tuple[int, int]] = []
        prompt_rows: list[tuple[int, int, int]] = []
        pooled_rows: list[tuple[int, int, int]] = []
        spans: list[list[tuple[int, int]]] = []  # per request, the image spans its chunk prefills
        image_rows: list[tuple[ImageSpan, int, int, int]] = []
        token_types: list[int] = []  # BERT's: each row's text of a pair (0: a row of anything but a score)
        for index, item in enumerate(scheduled):
            seq, start, end = item.seq, item.start, item.start + item.num_tokens
            num_pages = -(-end // page_size)
            for kv_group, pages in enumerate(seq.kv_pages):
                pages = pages if len(pages) == num_pages else pages[:num_pages]
                slots[kv_group] += [
                    pages[position // page_size] * page_size + position % page_size for position in range(start, end)
                ]
                page_indices[kv_group] += pages
            row = qo_offsets[-1]
            if item.draft:
                token_ids += seq.token_ids[start : end - len(item.draft)] + item.draft
            else:
                token_ids += seq.token_ids[start:end]
            positions.add(item.group.images, start, end)
            if self.reads_token_types:
                token_types += item.group.pooling.segments(start, end) if item.group.pools else [0] * item.num_tokens
            qo_offsets.append(row + item.num_tokens)
            lora_runs.append((item.group.adapter, item.num_tokens))
            mine = [] if item.draft else [span for span in item.group.images if span.start < end and span.end > start]
            spans.append([(span.start, span.end) for span in mine])
            for span in mine:
                first, stop = max(span.start, start), min(span.end, end)
                image_rows.append((span, row + first - start, first - span.start, stop - first))
            kv_offsets.append(kv_offsets[-1] + num_pages)
            last_page_lens.append(end - (num_pages - 1) * page_size)
            if item.group.pools:
                pooled_rows.append((index, row, item.num_tokens))
            elif item.draft:
                sample_rows.append((index, row))  # its first row: the runner verifies the proposals on it and after
            elif end == seq.num_tokens:
                sample_rows.append((index, row + item.num_tokens - 1))
            prompt_len = len(item.group.prompt_token_ids)
            if item.group.needs_prompt_logprobs and start < prompt_len - 1 and seq is item.group.seqs[0]:
                prompt_rows.append((index, row, min(end, prompt_len - 1) - start))
        device = self.device
        lora = cast("LoraSet | None", self.model.lora)
        if lora is not None:
            lora.plan.update(lora_runs, device)

        def on_device(values: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)

        qo_indptr = on_device(qo_offsets)
        kv_indptr = on_device(kv_offsets)
        last_page_len = on_device(last_page_lens)
        metas = [
            AttentionMetadata(
                qo_indptr=qo_indptr,
                kv_indptr=kv_indptr,
                kv_indices=on_device(page_indices[kv_group]),
                kv_last_page_len=last_page_len,
                slot_mapping=on_device(slots[kv_group], torch.int64),
                page_size=page_size,
                is_decode=len(token_ids) == len(scheduled),
                bidirectional=spans if image_rows and self.bidirectional[kv_group] else None,
            )
            for kv_group in kv_groups
        ]
        return StepInputs(
            input_ids=on_device(token_ids, torch.long),
            token_type_ids=on_device(token_types, torch.long) if self.reads_token_types else None,
            positions=positions.tensor(device),
            metas=metas,
            sample_rows=sample_rows,
            prompt_rows=prompt_rows,
            pooled_rows=pooled_rows,
            image_rows=image_rows,
        )

    def _encode_images(
        self, image_rows: list[tuple[ImageSpan, int, int, int]]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows, embeddings) of the step's image soft tokens: each image not yet encoded through the tower once.
        None where the step's image tokens take no feature (a chunk of an image's break and end tokens alone)."""
        # (a span's break tokens keep their own embeddings: only its other tokens take features)
        wanted = [(span, row, first, count, *span.features(first, count)) for span, row, first, count in image_rows]
        wanted = [w for w in wanted if len(w[-1])]
        todo = [span for span in {id(w[0]): w[0] for w in wanted}.values() if span.encoded is None]
        if todo:
            embeds = cast(VisionModel, self.model).encode_images(
                [span.pixels.to(self.device) for span in todo], [span.grid for span in todo]
            )  # each [tokens, width]
            for span, embed in zip(todo, embeds, strict=True):
                span.encoded = embed
            self.num_images_encoded += len(todo)
        offsets, pieces = [], []
        for span, row, _, _, at, features in wanted:
            assert span.encoded is not None, "each span of the step is encoded (above) until its last tokens"
            offsets.append(row + at)
            pieces.append(span.encoded[features.to(span.encoded.device)])
        for span, _, first, count in image_rows:
            if first + count == span.end - span.start:  # its last tokens: the encoding is not needed again
                span.encoded = None
        return (torch.cat(offsets).to(self.device), torch.cat(pieces)) if pieces else None

    def _recurrent_step(self, scheduled: list[ScheduledSeq], is_decode: bool) -> RecurrentStep:
        spans: list[tuple[int, int]] = []  # (first row, rows) of each sequence
        slots: list[int] = []
        captures: list[tuple[int, int, int]] = []  # (scheduled index, row of the page boundary, snapshot slot)
        row = 0
        for index, item in enumerate(scheduled):
            spans.append((row, item.num_tokens))
            assert item.seq.state_slot is not None, "a hybrid model's running sequence holds a state slot"
            slots.append(item.seq.state_slot)
            if item.seq.state_capture is not None:
                boundary, slot = item.seq.state_capture
                captures.append((index, boundary - item.start, slot))
            row += item.num_tokens
        verifying = frozenset(index for index, item in enumerate(scheduled) if item.draft)
        slot_index = torch.tensor(slots, device=self.device)
        return RecurrentStep(
            spans=spans, slots=slots, captures=captures, slot_index=slot_index, is_decode=is_decode, verify=verifying
        )

    @torch.inference_mode()
    def settle(self, out: SchedulerOutput) -> None:
        """After the scheduler committed a step: each speculating sequence's recurrent state advances by the rows it
        kept (engine/model/layers/recurrent_step.py), before any later step, fork or snapshot copy reads it."""
        if self.recurrent_plan is not None:
            kept = {
                index: item.seq.num_computed_tokens - item.start
                for index, item in enumerate(out.scheduled)
                if item.draft
            }
            if self.peers is not None and kept:
                self.peers.send_settle(kept)
            self.recurrent_plan.settle(kept)

    def _prompt_logprobs(
        self,
        hidden: torch.Tensor,
        scheduled: list[ScheduledSeq],
        prompt_rows: list[tuple[int, int, int]],
        result: StepResult,
    ) -> None:
        for index, row, count in prompt_rows:
            item = scheduled[index]
            num_top = item.group.params.prompt_logprobs or 0
            targets = item.group.prompt_token_ids[item.start + 1 : item.start + 1 + count]
            entries: list[tuple[float, list[tuple[int, float]]]] = []
            for first in range(0, count, PROMPT_LOGPROB_SLICE):
                stop = min(count, first + PROMPT_LOGPROB_SLICE)
                logits = self._logits(hidden[row + first : row + stop])
                entries += compute_logprobs(logits, targets[first:stop], num_top)
            result.prompt_logprobs[index] = entries

    def _sample(self, logits: torch.Tensor, items: list[tuple[int, ScheduledSeq]], result: StepResult) -> None:
        """items[j] owns logits row j. Beams get their candidates, everything else one sampler call."""
        rows: list[SamplingRow] = []
        owners: list[int] = []  # logits row of each sampling row
        for logits_row, (_, item) in enumerate(items):
            group = item.group
            if group.beam is not None:
                continue
            # A group's first token is drawn once per choice, from the prompt's one logits row.
            seqs = group.seqs if not group.forked else [item.seq]
            rows += [self._row(group, seq) for seq in seqs]
            owners += [logits_row] * len(seqs)
        if rows:
            owner_rows = torch.tensor(owners, device=logits.device)
            try:
                self._draw(logits.index_select(0, owner_rows), rows=rows, owners=owners, items=items, result=result)
            except Exception:
                # One request's bad parameters must not fail the batch: retry each sequence alone.
                for logits_row, (scheduled_index, _) in enumerate(items):
                    mine = [row for row, owner in zip(rows, owners, strict=True) if owner == logits_row]
                    if not mine:
                        continue
                    try:
                        alone = logits[logits_row : logits_row + 1].expand(len(mine), -1)
                        self._draw(alone, rows=mine, owners=[logits_row] * len(mine), items=items, result=result)
                    except Exception as exc:
                        result.errors[scheduled_index] = exc
        for logits_row, (scheduled_index, item) in enumerate(items):
            if item.group.beam is not None:
                try:
                    result.samples[scheduled_index] = self._beam_candidates(logits[logits_row : logits_row + 1], item)
                except Exception as exc:
                    result.errors[scheduled_index] = exc

    def _draw(
        self,
        logits: torch.Tensor,
        *,
        rows: list[SamplingRow],
        owners: list[int],
        items: list[tuple[int, ScheduledSeq]],
        result: StepResult,
    ) -> None:
        out = self.sampler(logits, rows)
        tops = out.top_logprobs
        samples: dict[int, list[Sample]] = {}
        for sampling_index, owner in enumerate(owners):
            wants_top = tops is not None and rows[sampling_index].params.logprobs is not None
            top = tops[sampling_index] if tops is not None and wants_top else None
            sample = Sample(out.token_ids[sampling_index], out.logprobs[sampling_index], top)
            samples.setdefault(items[owner][0], []).append(sample)
        result.samples.update(samples)

    def _beam_candidates(self, logits: torch.Tensor, item: ScheduledSeq) -> list[Sample]:
        """The 2*width best next tokens of one beam, by logprob after masks and penalties."""
        row = self._row(item.group, item.seq)
        logprobs = torch.log_softmax(process_logits(logits, [row]), dim=-1)[0]
        beam = item.group.beam
        assert beam is not None, "_sample asks for the candidates of beam groups only"
        values, token_ids = logprobs.topk(min(2 * beam.width, logprobs.numel()))
        # A grammar can leave fewer allowed tokens than candidates asked for: masked ones never extend a beam.
        candidates = zip(token_ids.tolist(), values.tolist(), strict=True)
        return [Sample(token_id, logprob) for token_id, logprob in candidates if logprob != float("-inf")]

    @staticmethod
    def _row(group: SequenceGroup, seq: Sequence) -> SamplingRow:
        return sampling_row(group, seq)
