"""A bf16 lm_head's logits are float32 and exact near each row's maximum: the greedy token is the argmax of the
float32 logits even where bf16 rounding makes the top two equal, and rows not asked for are only cast."""

from __future__ import annotations

import torch

from engine.model.layers.logits import refine_near_max


def tied_head(gap: float = 0.04) -> tuple[torch.Tensor, torch.Tensor]:
    """A hidden state and a head whose rows 3 and 7 score 20 and 20 + gap in float32: both 20.0 in bf16, where
    argmax takes the lower id, 3."""
    gen = torch.Generator().manual_seed(0)
    weight = (0.01 * torch.randn(16, 8, generator=gen)).to(torch.bfloat16)
    weight[:, :2] = 0.0
    weight[3, 0], weight[7, 0], weight[7, 1] = 20.0, 20.0, gap
    hidden = torch.zeros(8, dtype=torch.bfloat16)
    hidden[:2] = 1.0
    return hidden, weight


def test_the_greedy_token_is_the_float32_argmax_where_bf16_rounding_ties():
    hidden, weight = tied_head()
    rounded = hidden[None] @ weight.T
    assert rounded[0, 3] == rounded[0, 7] and int(rounded.float().argmax()) == 3
    exact = hidden[None].float() @ weight.T.float()
    refined = refine_near_max(rounded, hidden[None], weight)
    assert refined.dtype == torch.float32
    assert int(refined.argmax()) == int(exact.argmax()) == 7
    torch.testing.assert_close(refined[0, [3, 7]], exact[0, [3, 7]])
    # Far from the maximum the rounded values stay as they were.
    far = [i for i in range(16) if i not in (3, 7)]
    assert torch.equal(refined[0, far], rounded.float()[0, far])


def test_only_the_rows_asked_for_are_recomputed():
    hidden, weight = tied_head()
    hidden = torch.stack([hidden, hidden])
    rounded = hidden @ weight.T
    refined = refine_near_max(rounded, hidden, weight, rows=torch.tensor([1]))
    assert int(refined[0].argmax()) == 3 and refined[0, 3] == refined[0, 7]  # cast only: still the tie
    assert int(refined[1].argmax()) == 7
    assert torch.equal(
        refine_near_max(rounded, hidden, weight, rows=torch.tensor([], dtype=torch.long)), rounded.float()
    )


def test_float32_logits_are_returned_as_they_are():
    hidden, weight = tied_head()
    logits = hidden[None].float() @ weight.T.float()
    assert torch.equal(refine_near_max(logits, hidden[None].float(), weight.float()), logits)


def test_a_head_bias_counts_in_the_recomputed_entries():
    """Phi-3.5-MoE's lm_head has a bias: the entries near the maximum are recomputed with it, in float32."""
    hidden, weight = tied_head()
    bias = torch.zeros(16, dtype=torch.bfloat16)
    bias[3] = 0.03125  # float32: row 3 scores 20.03125, row 7 20.04 - 0.0625: row 3 wins
    bias[7] = -0.0625
    rounded = torch.nn.functional.linear(hidden[None], weight, bias)
    exact = hidden[None].float() @ weight.T.float() + bias.float()
    refined = refine_near_max(rounded, hidden[None], weight, bias=bias)
    assert int(refined.argmax()) == int(exact.argmax()) == 3
    torch.testing.assert_close(refined[0, [3, 7]], exact[0, [3, 7]])
