"""Float32 logits from an lm_head that runs in bfloat16 or float16, exact where the greedy token is decided.

A bf16 matmul accumulates in float32 but rounds each output to 8 significant bits: at |logit| in [16, 32) the
step is 0.125, so two tokens whose float32 logits differ by less than that come out equal and argmax takes the
lower id. On SmolLM2-135M with FP8 KV pages the first answer token of "What is the capital of France?" is such
a case ("The" -1.935 against "L" -1.977 in float32, both -1.98 after bf16 rounding). Recomputing the whole head
in float32 costs 4.5x the bf16 head on a CPU (measured 10.7 against 2.4 ms at batch 1 on SmolLM2's 49152 x 576);
recomputing only the entries within two rounding steps of a row's maximum (one to four of them) costs 0.13 ms a
row, which is why the model runner asks for it on the rows that sample greedily.
"""

from __future__ import annotations

import torch

# Entries this many output rounding steps below a row's maximum may hold its float32 argmax.
TIE_STEPS = 2


def refine_near_max(
    logits: torch.Tensor,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    rows: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`logits` (= hidden @ weight.T + bias rounded to hidden's dtype) in float32, the entries near the maximum of
    each row in `rows` (all rows: None) recomputed from `hidden`, `weight` [vocab, hidden] and `bias` in float32."""
    out = logits.float()
    if logits.dtype == torch.float32 or (rows is not None and rows.numel() == 0):
        return out
    picked = out if rows is None else out.index_select(0, rows)
    top = picked.amax(dim=-1, keepdim=True)
    # The rounding step at each row's maximum: eps (2^-7 for bf16, 2^-10 for fp16) times its power of two.
    step = torch.finfo(logits.dtype).eps * torch.exp2(torch.floor(torch.log2(top.abs().clamp_min(1e-30))))
    r, cols = (picked >= top - TIE_STEPS * step).nonzero(as_tuple=True)
    if rows is not None:
        r = rows.index_select(0, r)
    exact = torch.einsum("nh,nh->n", weight.index_select(0, cols).float(), hidden.index_select(0, r).float())
    out[r, cols] = exact if bias is None else exact + bias.index_select(0, cols).float()
    return out
