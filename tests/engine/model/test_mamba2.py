"""The Mamba2 mixer (Nemotron-H's `M` layer) in float32: the SSD alone (the chunked scan equal to the one-token
recurrence token by token, from a given state, and to transformers' torch reference), and the whole mixer over state
slots: one pass equal to the same prompt in chunks and then token-by-token decode, several sequences in one step
equal to each alone, and a snapshot taken inside a step equal to the state a run to there leaves."""

from __future__ import annotations

import pytest
import torch

from engine.model.layers import ssd
from engine.model.layers.mamba2 import Mamba2Mixer, Mamba2Shape
from engine.model.layers.recurrent_step import RecurrentStep

ATOL = 2e-5
SHAPE = Mamba2Shape(
    hidden_size=32, num_heads=8, head_dim=4, n_groups=2, state_size=8, conv_kernel=4, chunk_size=8, eps=1e-5
)


def ssd_inputs(length: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(length, 6, 4, generator=gen)
    dt = torch.rand(length, 6, generator=gen) * 0.8 + 0.05
    a = -torch.rand(6, generator=gen) * 2 - 0.1
    b, c = (torch.randn(length, 3, 5, generator=gen) for _ in range(2))
    state = torch.randn(6, 4, 5, generator=gen) * 0.5
    return x, dt, a, b, c, state


@pytest.mark.parametrize("chunk", [4, 16])
@pytest.mark.parametrize("length", [1, 3, 16, 37])
def test_the_chunked_scan_equals_the_recurrence_token_by_token(length, chunk):
    from transformers.models.nemotron_h.modeling_nemotron_h import mamba2_chunk_scan

    x, dt, a, b, c, state = ssd_inputs(length, length * chunk)
    want, want_state = ssd.recurrent(x, dt, a, b, c, state)
    got, got_state = ssd.chunked(x, dt, a, b, c, state, chunk)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(got_state, want_state, atol=ATOL, rtol=1e-4)
    ref, ref_state = mamba2_chunk_scan(
        x[None], dt[None], a, b[None], c[None], chunk_size=chunk, initial_states=state[None], return_final_states=True
    )
    torch.testing.assert_close(got, ref[0], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(got_state, ref_state[0], atol=ATOL, rtol=1e-4)


@pytest.fixture(scope="module")
def mixer():
    torch.manual_seed(0)
    layer = Mamba2Mixer(SHAPE)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            p.copy_(0.3 * torch.randn_like(p) + (1.0 if name == "norm.weight" else 0.0))
    return layer.eval()


def pools(slots: int = 6):
    conv, state = SHAPE.state_shapes()
    return torch.zeros(slots, *conv), torch.zeros(slots, *state)


def step(lengths: list[int], slots: list[int], captures=()) -> RecurrentStep:
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return RecurrentStep(
        spans=list(zip(starts, lengths, strict=True)),
        slots=slots,
        captures=list(captures),
        slot_index=torch.tensor(slots),
        is_decode=all(n == 1 for n in lengths),
    )


def test_chunks_and_decode_carry_the_state_over(mixer):
    x = torch.randn(30, SHAPE.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        whole = mixer(x, step([30], [0]), *pools())
        conv, state = pools()
        parts = [mixer(x[:2], step([2], [1]), conv, state), mixer(x[2:19], step([17], [1]), conv, state)]
        parts += [mixer(x[t : t + 1], step([1], [1]), conv, state) for t in range(19, 30)]
    torch.testing.assert_close(torch.cat(parts), whole, atol=ATOL, rtol=1e-4)


def test_sequences_in_one_step_equal_each_alone(mixer):
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(n, SHAPE.hidden_size, generator=gen) for n in (5, 1, 21)]
    with torch.inference_mode():
        together = mixer(torch.cat(xs), step([5, 1, 21], [4, 0, 2]), *pools())
        alone = [mixer(x, step([len(x)], [3]), *pools()) for x in xs]
    torch.testing.assert_close(together, torch.cat(alone), atol=ATOL, rtol=1e-4)


def test_a_snapshot_inside_a_step_is_the_state_a_run_to_there_leaves(mixer):
    x = torch.randn(23, SHAPE.hidden_size, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        conv, state = pools()
        mixer(x, step([23], [0], captures=[(0, 13, 5)]), conv, state)
        ran_conv, ran_state = pools()
        mixer(x[:13], step([13], [1]), ran_conv, ran_state)
    torch.testing.assert_close(conv[5], ran_conv[1])
    torch.testing.assert_close(state[5], ran_state[1], atol=ATOL, rtol=1e-4)
