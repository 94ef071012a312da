"""The penalties as the engine applied them before per-sequence counts (copied from logits_processor.py at the
commit before engine/sample/penalties.py): every token of every penalised row listed anew each step. The
reference that the running counts are held to."""

from __future__ import annotations

import torch

from engine.sample.logits_processor import SamplingRow


def reference_penalties(out: torch.Tensor, rows: list[tuple[int, SamplingRow]]) -> None:
    """In place, touching only the (row, token) pairs that occur: repetition, then frequency and presence."""
    device = out.device
    vocab = out.shape[1]
    flat = out.view(-1)
    per_row = [[1.0] * out.shape[0], [0.0] * out.shape[0], [0.0] * out.shape[0]]
    for i, row in rows:
        p = row.params
        per_row[0][i], per_row[1][i], per_row[2][i] = p.repetition_penalty, p.frequency_penalty, p.presence_penalty
    rep, freq, presence = torch.tensor(per_row, device=device)

    out_keys, out_counts = torch.unique(_pair_keys(rows, vocab, device, prompt=False), return_counts=True)
    rep_rows = [(i, r) for i, r in rows if r.params.repetition_penalty != 1.0]
    if rep_rows:
        # Repetition covers the prompt and the output; a token counts once however often it occurs.
        seen = torch.unique(torch.cat([_pair_keys(rep_rows, vocab, device, prompt=True), out_keys]))
        values = flat[seen]
        penalty = rep[seen // vocab]
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if out_keys.numel():
        owner = out_keys // vocab
        flat[out_keys] -= freq[owner] * out_counts + presence[owner]


def _pair_keys(rows: list[tuple[int, SamplingRow]], vocab: int, device: torch.device, prompt: bool) -> torch.Tensor:
    """row * vocab + token for every token of each row's prompt (or output), as one flat tensor."""
    keys = [i * vocab + t for i, r in rows for t in (r.prompt_token_ids if prompt else r.output_token_ids)]
    return torch.tensor(keys, dtype=torch.long, device=device)
