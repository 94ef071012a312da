"""What rank 0 sends the other ranks: a fixed-size command header (down each rank's pipe), then the step's
integers packed in one int64 tensor, or the hidden rows to turn into logits (on the model's device group).

A step is its token ids, positions, the CSR page table (qo / kv indptr and last page lengths, shared by the KV
groups; each group's page indices and slots) and the page copies to make first: everything a rank needs to run its
heads over its own KV pages, whose page ids are the scheduler's and the same on every rank. A hybrid model's step
adds its recurrent-state slot copies, each sequence's slot and the snapshots to take: the slot ids are rank 0's
scheduler's too, each rank's state pool holding its own heads' states in them. With LoRA adapters, the step's rows
per adapter slot travel too (LoraPlan.runs; -1: no adapter). An adapter loaded while serving is a LORA command
whose header names its slot, followed down the pipe by its name and folder (JSON), which each rank reads itself.
A speculative verify on a hybrid model sends which sequences' rows verify (their states are not written by the
forward); once rank 0 knows how many rows of each it kept, a SETTLE command (the counts down the pipe) has every
rank replay them into its states.

An image-text model's step may carry 3-D positions (Qwen-VL's mrope: [3, T], already shifted past each image), the
spans whose tokens see each other both ways (Gemma 3; each KV group's flag in a bitmask) and its image soft tokens'
embeddings: rank 0 alone runs the vision tower, so their rows travel in the payload and their values (in the model's
dtype, Qwen3-VL's deepstack features beside them) in one float broadcast after it. Every rank then embeds the same
rows with the same values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from engine.attention.base import AttentionMetadata
from engine.model.layers.recurrent_step import RecurrentStep

STEP, LOGITS, CACHE, STOP, LORA, SETTLE = 1, 2, 3, 4, 5, 6
MAX_GROUPS = 8  # KV layer groups a step header has room for (the sharded families have one or two)
FIXED = 17  # the command and a step's counts before the groups' sizes
FLOATS = (torch.float32, torch.bfloat16, torch.float16)  # an image embedding broadcast's dtype, by its index
HEADER_LEN = FIXED + 2 * MAX_GROUPS


def header(command: int, *fields: int) -> torch.Tensor:
    out = torch.zeros(HEADER_LEN, dtype=torch.int64)
    out[0] = command
    if fields:
        out[1 : 1 + len(fields)] = torch.tensor(fields, dtype=torch.int64)
    return out


@dataclass(kw_only=True)
class Step:
    """One forward's inputs as every rank builds them."""

    copies: list[list[tuple[int, int]]]  # per KV group: (src, dst) pages to copy before the step
    input_ids: torch.Tensor
    positions: torch.Tensor
    metas: list[AttentionMetadata]  # per KV group
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) state slots, in order
    recurrent: RecurrentStep | None = None  # a hybrid model's plan for its recurrent layers
    lora_runs: list[tuple[int | None, int]] = field(default_factory=list)  # (adapter slot, rows), in row order
    # An image-text step's (rows, embeddings): the values are empty here, for the caller to receive by broadcast.
    image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None


def pack_step(
    copies: list[tuple[int, int, int]],
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    metas: list[AttentionMetadata],
    state_copies: Sequence[tuple[int, int]] = (),
    recurrent: RecurrentStep | None = None,
    lora_runs: Sequence[tuple[int | None, int]] = (),
    image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, payload) of one step; the payload is on the tensors' device. image_embeds: (rows, values), whose
    values the caller broadcasts after the payload."""
    first = metas[0]
    parts = [input_ids, positions.reshape(-1), first.qo_indptr, first.kv_indptr, first.kv_last_page_len]
    for m in metas:
        parts += [m.kv_indices, m.slot_mapping]
    flat = [v for c in copies for v in c] + [v for c in state_copies for v in c]
    if recurrent is not None:  # its spans are the page table's qo_indptr: only the slots, snapshots and verifies
        flat += recurrent.slots + [v for c in recurrent.captures for v in c] + sorted(recurrent.verify)
    flat += [v for slot, n in lora_runs for v in (-1 if slot is None else slot, n)]
    # The groups' bidirectional spans are one list (a group has it or not): (request, start, end) each
    both_ways = next((m.bidirectional for m in metas if m.bidirectional), [])
    flat += [v for i, spans in enumerate(both_ways) for span in spans for v in (i, *span)]
    parts.append(torch.tensor(flat, dtype=torch.int64).to(input_ids.device))
    rows, image = input_ids[:0], (0, 0)  # the image rows, and their values' width and dtype
    if image_embeds is not None:
        rows, values = image_embeds
        image = values.shape[1], FLOATS.index(values.dtype)
    parts.append(rows)
    payload = torch.cat([p.to(torch.int64) for p in parts])
    sizes = [n for m in metas for n in (m.kv_indices.numel(), m.slot_mapping.numel())]
    fields = [
        input_ids.numel(),
        first.qo_indptr.numel() - 1,
        int(first.is_decode),
        len(metas),
        len(copies),
        len(state_copies),
        int(recurrent is not None),
        len(recurrent.captures) if recurrent else 0,
        len(lora_runs),
        len(recurrent.verify) if recurrent else 0,
        positions.numel() // max(1, input_ids.numel()),
        sum(1 << g for g, m in enumerate(metas) if m.bidirectional),
        sum(len(s) for s in both_ways),
        rows.numel(),
        *image,
        *sizes,
    ]
    return header(STEP, *fields), payload


def _counts(head: torch.Tensor) -> tuple[list[int], list[int]]:
    """A step header's counts (FIXED - 1 of them) and its groups' page-list sizes."""
    counts = head[1:FIXED].tolist()
    return counts, head[FIXED : FIXED + 2 * counts[3]].tolist()


def payload_len(head: torch.Tensor) -> int:
    (
        (
            tokens,
            batch,
            _,
            _,
            copies,
            state_copies,
            recurrent,
            captures,
            runs,
            verify,
            position_rows,
            _,
            both_ways,
            image_rows,
            _,
            _,
        ),
        sizes,
    ) = _counts(head)
    return (
        (1 + position_rows) * tokens
        + 2 * (batch + 1)
        + batch
        + sum(sizes)
        + 3 * copies
        + 2 * state_copies
        + recurrent * batch
        + 3 * captures
        + verify
        + 2 * runs
        + 3 * both_ways
        + image_rows
    )


def unpack_step(head: torch.Tensor, payload: torch.Tensor, page_size: int) -> Step:
    (
        (
            tokens,
            batch,
            is_decode,
            groups,
            num_copies,
            state_copies,
            recurrent,
            captures,
            runs,
            verify,
            position_rows,
            both_mask,
            both_ways,
            image_rows,
            width,
            dtype,
        ),
        sizes,
    ) = _counts(head)
    i32 = torch.int32
    cuts = [
        tokens,
        position_rows * tokens,
        batch + 1,
        batch + 1,
        batch,
        *sizes,
        3 * num_copies,
        2 * state_copies,
        recurrent * batch,
        3 * captures,
        verify,
        2 * runs,
        3 * both_ways,
        image_rows,
    ]
    pieces = list(torch.split(payload, cuts))
    rows = pieces.pop()
    spans: list[list[tuple[int, int]]] = [[] for _ in range(batch)]
    for i, start, end in pieces.pop().view(-1, 3).tolist():
        spans[i].append((start, end))
    lora_runs = [(None if slot < 0 else slot, n) for slot, n in pieces.pop().view(-1, 2).tolist()]
    input_ids, positions, qo, kv, last = pieces[:5]
    qo, kv, last = qo.to(i32), kv.to(i32), last.to(i32)
    metas = [
        AttentionMetadata(
            qo_indptr=qo,
            kv_indptr=kv,
            kv_indices=pieces[5 + 2 * g].to(i32),
            kv_last_page_len=last,
            slot_mapping=pieces[6 + 2 * g],
            page_size=page_size,
            is_decode=bool(is_decode),
            bidirectional=spans if both_mask >> g & 1 else None,
        )
        for g in range(groups)
    ]
    flat = pieces[-5].view(-1, 3).tolist()
    copies = [[(s, d) for h, s, d in flat if h == g] for g in range(groups)]
    step = Step(
        copies=copies,
        input_ids=input_ids,
        positions=positions.view(position_rows, tokens) if position_rows > 1 else positions,
        metas=metas,
        state_copies=[tuple(c) for c in pieces[-4].view(-1, 2).tolist()],
        lora_runs=lora_runs,
    )
    if image_rows:
        step.image_embeds = rows, torch.empty((image_rows, width), dtype=FLOATS[dtype], device=payload.device)
    if recurrent:
        starts = qo.tolist()
        steps = [(starts[i], starts[i + 1] - starts[i]) for i in range(batch)]
        slots = pieces[-3]
        step.recurrent = RecurrentStep(
            spans=steps,
            slots=slots.tolist(),
            captures=[tuple(c) for c in pieces[-2].view(-1, 3).tolist()],
            slot_index=slots,
            is_decode=bool(is_decode),
            verify=frozenset(pieces[-1].tolist()),
        )
    return step
