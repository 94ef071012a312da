"""Gated DeltaNet (Qwen3.5 / Qwen3-Next's linear attention) against transformers' torch reference in float32: the
delta rule alone (chunked and recurrent, from a given state, Hk < Hv), and the whole layer on a tiny random
Qwen3.5 config: one pass, the same prompt in chunks with its state carried over, token-by-token decode, and
several sequences in one step, each equal to transformers' pass over the whole sequence. Decode on both of its
paths (the CPU's in place, the capture-safe one CUDA and its graphs run) equal to each other, and the capture-safe
one replayed from a trace on other slots."""

from __future__ import annotations

import pytest
import torch

from engine.model.layers import delta_rule
from engine.model.layers.gated_deltanet import DeltaNetShape, GatedDeltaNet
from engine.model.layers.recurrent_step import RecurrentStep

ATOL = 2e-5
CONFIG = dict(
    hidden_size=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    num_hidden_layers=1,
    layer_types=["linear_attention"],
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
)


def rule_inputs(length: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(length, 2, 16, generator=gen) for _ in range(2))
    v = torch.randn(length, 4, 8, generator=gen)
    g = -torch.rand(length, 4, generator=gen) * 0.5
    beta = torch.rand(length, 4, generator=gen)
    state = torch.randn(4, 16, 8, generator=gen) * 0.3
    return q, k, v, g, beta, state


@pytest.mark.parametrize("length", [1, 5, 64, 150])
def test_the_delta_rule_matches_transformers_from_a_state(length):
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    q, k, v, g, beta, state = rule_inputs(length, length)
    args = (q[None], k[None], v[None])
    kw = dict(
        g=g[None], beta=beta[None], initial_state=state[None], output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    ref_out, ref_state = torch_recurrent_gated_delta_rule(*args, **kw)
    chunk_out, chunk_state = torch_chunk_gated_delta_rule(*args, **kw)
    for rule in (delta_rule.recurrent, delta_rule.chunked):
        out, new_state = rule(q, k, v, g, beta, state)
        torch.testing.assert_close(out, ref_out[0], atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(new_state, ref_state[0], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(chunk_out, ref_out, atol=ATOL, rtol=1e-4)  # transformers' two forms agree too
    if length == 1:  # decode's in-place single step
        held = delta_rule.held_form(state)
        out = delta_rule.step_(q[0], k[0], v[0], g[0], beta[0], held)
        torch.testing.assert_close(out, ref_out[0, 0], atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(delta_rule.materialise(held), ref_state[0], atol=ATOL, rtol=1e-4)


@pytest.mark.parametrize("capturable", [False, True])
def test_decode_steps_keep_the_state_through_its_scale_and_folds(capturable):
    """Token after token, decode keeps S / c and log c; with decays as steep as e^-30 a token, some heads' scales
    cross the floor and fold while others keep decaying slowly: outputs and states stay those of the plain rule."""
    q, k, v, g, beta, state = rule_inputs(120, 7)
    g = g * torch.tensor([0.1, 2.0, 30.0, 60.0])  # per value head: slow to steep decays
    held, scales, folds = delta_rule.held_form(state), [], 0
    for t in range(120):
        before = held[:, -1, 0].clone()
        out = delta_rule.step_(q[t], k[t], v[t], g[t], beta[t], held, capturable)
        scales.append(held[:, -1, 0].clone())
        folds += int(((held[:, -1, 0] == 0) & (before + g[t] < 0)).sum())
        ref_out, _ = delta_rule.recurrent(q[: t + 1], k[: t + 1], v[: t + 1], g[: t + 1], beta[: t + 1], state)
        torch.testing.assert_close(out, ref_out[-1], atol=ATOL, rtol=1e-4)
    _, ref_state = delta_rule.recurrent(q, k, v, g, beta, state)
    torch.testing.assert_close(delta_rule.materialise(held), ref_state, atol=ATOL, rtol=1e-4)
    assert min(float(s.min()) for s in scales) < -30 and folds > 10  # the scale and its folds were exercised
    assert float(torch.stack(scales).min()) >= delta_rule.LOG_SCALE_FLOOR


@pytest.fixture(scope="module")
def layers():
    import transformers as tf
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(0)
    config = tf.AutoConfig.for_model("qwen3_5_text", **CONFIG)
    hf = Qwen3_5GatedDeltaNet(config, 0).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if name == "norm.weight" else 0.3 * torch.randn_like(p))
    ours = GatedDeltaNet(
        DeltaNetShape(
            hidden_size=64,
            num_k_heads=2,
            num_v_heads=4,
            head_k_dim=16,
            head_v_dim=8,
            conv_kernel=4,
            eps=config.rms_norm_eps,
        )
    )
    ours.load_state_dict(hf.state_dict())
    return hf, ours.eval()


def states(ours: GatedDeltaNet, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    conv, delta = ours.shape.state_shapes()
    return torch.zeros(n, *conv), torch.zeros(n, *delta)


def plan(spans: list[tuple[int, int]], captures=()) -> RecurrentStep:
    slots = list(range(len(spans)))
    return RecurrentStep(
        spans=spans,
        slots=slots,
        captures=list(captures),
        slot_index=torch.tensor(slots),
        is_decode=all(n == 1 for _, n in spans),
    )


def reference(hf, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(x[None])[0]


@pytest.mark.parametrize("length", [1, 3, 70, 140])
def test_one_pass_matches_transformers(layers, length):
    hf, ours = layers
    x = torch.randn(length, 64, generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        got = ours(x, plan([(0, length)]), *states(ours, 1))
    torch.testing.assert_close(got, reference(hf, x), atol=ATOL, rtol=1e-4)


def test_chunks_and_decode_carry_the_state_over(layers):
    hf, ours = layers
    x = torch.randn(90, 64, generator=torch.Generator().manual_seed(1))
    conv, delta = states(ours, 1)
    pieces = []
    with torch.no_grad():
        for lo, hi in ((0, 2), (2, 67), (67, 80)) + tuple((t, t + 1) for t in range(80, 90)):
            pieces.append(ours(x[lo:hi], plan([(0, hi - lo)]), conv, delta))
    torch.testing.assert_close(torch.cat(pieces), reference(hf, x), atol=ATOL, rtol=1e-4)


def test_sequences_in_one_step_equal_each_alone(layers):
    hf, ours = layers
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(n, 64, generator=gen) for n in (7, 1, 66)]
    spans, start = [], 0
    for x in xs:
        spans.append((start, len(x)))
        start += len(x)
    with torch.no_grad():
        got = ours(torch.cat(xs), plan(spans), *states(ours, 3))
    torch.testing.assert_close(got, torch.cat([reference(hf, x) for x in xs]), atol=ATOL, rtol=1e-4)


def test_a_snapshot_inside_a_chunk_is_the_state_a_run_to_there_leaves(layers):
    """A capture at row 40 of a 70-row chunk holds what a 40-row prefill leaves: resuming from it gives the rest."""
    hf, ours = layers
    x = torch.randn(70, 64, generator=torch.Generator().manual_seed(3))
    conv, delta = states(ours, 2)
    with torch.no_grad():
        whole = ours(x, plan([(0, 70)], captures=[(0, 40, 1)]), conv, delta)
        # Slot 1 holds the snapshot: the last 30 rows run from it as a new sequence would from a prefix hit.
        step = RecurrentStep(spans=[(0, 30)], slots=[1], captures=[], slot_index=torch.tensor([1]), is_decode=False)
        rest = ours(x[40:], step, conv, delta)
    want = reference(hf, x)
    torch.testing.assert_close(whole, want, atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(rest, want[40:], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(conv[0], conv[1])  # both ran to the end of the sequence
    torch.testing.assert_close(delta[0], delta[1], atol=ATOL, rtol=1e-4)


def test_batched_decode_equals_each_sequence_alone(layers):
    hf, ours = layers
    gen = torch.Generator().manual_seed(4)
    xs = [torch.randn(n, 64, generator=gen) for n in (5, 9, 2)]
    conv, delta = states(ours, 3)
    with torch.no_grad():
        first = ours(torch.cat([x[:-1] for x in xs]), plan([(0, 4), (4, 8), (12, 1)]), conv, delta)
        last = ours(torch.stack([x[-1] for x in xs]), plan([(0, 1), (1, 1), (2, 1)]), conv, delta)
    for j, x in enumerate(xs):
        torch.testing.assert_close(last[j], reference(hf, x)[-1], atol=ATOL, rtol=1e-4)
    assert first.shape[0] == 13


def prefilled_pools(ours: GatedDeltaNet, xs: list[torch.Tensor], slots: list[int], n: int = 10):
    """Pools of n random slots; each x but its last row prefilled alone into its slot (zeroed first)."""
    gen = torch.Generator().manual_seed(5)
    conv, delta = states(ours, n)
    conv.normal_(generator=gen)
    delta.normal_(generator=gen)
    for x, slot in zip(xs, slots, strict=True):
        conv[slot], delta[slot] = 0, 0
        with torch.no_grad():
            ours(
                x[:-1],
                RecurrentStep(
                    spans=[(0, len(x) - 1)], slots=[slot], captures=[], slot_index=torch.tensor([slot]), is_decode=False
                ),
                conv,
                delta,
            )
    return conv, delta


def decode_inputs(slots: list[int]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randn(n, 64, generator=gen) for n in (4, 6, 3)][: len(slots)]


@pytest.mark.parametrize("path", ["cpu", "indexed"])
@pytest.mark.parametrize("slots", [[5, 2, 3], [0, 9], [3, 4, 5]])
def test_decode_in_any_slot_order_leaves_every_other_slot_untouched(layers, slots, path):
    """Slots out of order with an idle one between them (updated in place over the span), far apart (gathered) and
    in order, on the CPU's path and on the capture-safe one (a CUDA graph's step: slot_index alone, a padding row
    on a scratch slot): each sequence's row equals transformers', and the slots no sequence holds keep their bits."""
    hf, ours = layers
    xs = decode_inputs(slots)
    conv, delta = prefilled_pools(ours, xs, slots, n=11)
    before = conv.clone(), delta.clone()
    rows = torch.stack([x[-1] for x in xs])
    if path == "cpu":
        step = RecurrentStep(
            spans=[(i, 1) for i in range(len(slots))],
            slots=slots,
            captures=[],
            slot_index=torch.tensor(slots),
            is_decode=True,
        )
    else:
        step, rows = RecurrentStep.graphed(torch.tensor([*slots, 10])), torch.cat([rows, torch.ones(1, 64)])
    with torch.no_grad():
        last = ours(rows, step, conv, delta)
    for j, x in enumerate(xs):
        torch.testing.assert_close(last[j], reference(hf, x)[-1], atol=ATOL, rtol=1e-4)
    idle = [i for i in range(10) if i not in slots]
    assert torch.equal(conv[idle], before[0][idle]) and torch.equal(delta[idle], before[1][idle])


@pytest.mark.parametrize("slots", [[5, 2, 3], [0, 9], [3, 4, 5]])
def test_the_capture_safe_decode_equals_the_cpu_path(layers, slots):
    """Several steps on each path from the same pools: the same rows, and the same state in every slot."""
    _, ours = layers
    xs = decode_inputs(slots)
    pools = {path: prefilled_pools(ours, xs, slots) for path in ("cpu", "indexed")}
    gen = torch.Generator().manual_seed(6)
    for _ in range(3):
        rows = torch.randn(len(slots), 64, generator=gen)
        cpu = RecurrentStep(
            spans=[(i, 1) for i in range(len(slots))],
            slots=slots,
            captures=[],
            slot_index=torch.tensor(slots),
            is_decode=True,
        )
        with torch.no_grad():
            want = ours(rows, cpu, *pools["cpu"])
            got = ours(rows, RecurrentStep.graphed(torch.tensor(slots)), *pools["indexed"])
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    for a, b in zip(pools["cpu"], pools["indexed"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_a_traced_decode_step_replays_on_other_slots(layers):
    """make_fx records the tensor ops of one decode step and bakes every Python value into the trace, as CUDA graph
    capture does: the capture-safe step traced on some slots and replayed on others equals the eager step there
    (and the CPU's path, steered by Python ints and by the values of its scales, does not trace or does not
    replay: that is why graphs never run it)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    _, ours = layers
    gen = torch.Generator().manual_seed(7)
    conv, delta = (t.normal_(generator=gen) for t in states(ours, 10))

    def graphed(x, index, conv_pool, state_pool):
        return ours(x, RecurrentStep.graphed(index), conv_pool, state_pool)

    def cpu(x, index, conv_pool, state_pool):
        return ours(
            x,
            RecurrentStep(
                spans=[(0, 1), (1, 1), (2, 1)], slots=[1, 2, 3], captures=[], slot_index=index, is_decode=True
            ),
            conv_pool,
            state_pool,
        )

    x, slots = torch.randn(3, 64, generator=gen), torch.tensor([7, 0, 4])
    with torch.no_grad():
        want_pools = conv.clone(), delta.clone()
        want = graphed(x, slots, *want_pools)
        for step, replays in ((graphed, True), (cpu, False)):
            try:
                traced = make_fx(step)(torch.randn(3, 64), torch.tensor([1, 2, 3]), conv.clone(), delta.clone())
            except RuntimeError as exc:  # the CPU's path reads a tensor's value (its scale folds): no trace at all
                assert not replays and "data-dependent" in str(exc)
                continue
            pools = conv.clone(), delta.clone()
            got = traced(x, slots, *pools)
            same = torch.allclose(got, want) and all(torch.equal(a, b) for a, b in zip(pools, want_pools, strict=True))
            assert same == replays
