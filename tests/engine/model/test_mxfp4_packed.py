"""MXFP4 experts kept packed (as on CUDA: engine/model/quant/mxfp4_packed.py), run here on the CPU in float32:
the same logits as transformers on its dequantised weights, through both ways a step runs (fewer routed pairs than
experts: gathered; more: every expert, a chunk at a time), the experts holding nothing but their uint8 blocks and
scales, and the decode step capture-safe."""

from __future__ import annotations

import pytest
import torch

from engine.model.capture import capture_blocker
from engine.model.layers.moe import StackedExperts
from engine.model.loader import load_model
from engine.model.quant import mxfp4_experts, mxfp4_packed
from engine.model.quant.mxfp4_packed import PackedMxfp4
from tests.engine.model.family_parity import check_prefill_and_decode
from tests.engine.model.gpt_oss_checkpoints import build_gpt_oss
from tests.engine.model.test_capture_safety import decode_under_guard

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    return path, build_gpt_oss(path, "mxfp4")


@pytest.fixture(params=["whole layer", "one expert at a time"])
def packed(request, checkpoint, monkeypatch):
    """The checkpoint loaded with its experts packed; SCRATCH_BYTES 1 dequantises one expert (or pair) at a time."""
    monkeypatch.setattr(mxfp4_experts, "PACKED_DEVICES", ("cuda", "cpu"))
    if request.param == "one expert at a time":
        monkeypatch.setattr(mxfp4_packed, "SCRATCH_BYTES", 1)
    model, spec = load_model(str(checkpoint[0]), torch.float32, CPU)
    return model, spec, checkpoint[1]


def stacks(model) -> list[StackedExperts]:
    return [m for m in model.modules() if isinstance(m, StackedExperts)]


def test_experts_hold_only_their_blocks_and_scales(packed):
    model, _, _ = packed
    for experts in stacks(model):
        assert experts.runner is not None
        held = {name: p.dtype for name, p in experts.named_parameters()}
        assert held == {
            "gate_up_proj_blocks": torch.uint8,
            "gate_up_proj_scales": torch.uint8,
            "down_proj_blocks": torch.uint8,
            "down_proj_scales": torch.uint8,
            "gate_up_proj_bias": torch.float32,
            "down_proj_bias": torch.float32,
        }


@pytest.mark.parametrize("lengths", [(5, 13, 30), (11,)], ids=["three prompts: every expert", "one: gathered"])
def test_packed_experts_match_transformers(packed, lengths, monkeypatch):
    model, spec, hf = packed
    calls = {"_gathered": 0, "_all_experts": 0}
    for name in calls:

        def counted(self, *args, _run=getattr(PackedMxfp4, name), _name=name):  # noqa: B008 (binds this pass's method)
            calls[_name] += 1
            return _run(self, *args)

        monkeypatch.setattr(PackedMxfp4, name, counted)
    check_prefill_and_decode(model, spec, hf, lengths=lengths, decode_steps=6)
    layers = hf.config.num_hidden_layers
    # a decode step of one sequence routes 2 pairs to 4 experts; prefill and three sequences route more
    assert calls == (
        {"_gathered": 0, "_all_experts": 7 * layers}
        if len(lengths) > 1
        else {"_gathered": 6 * layers, "_all_experts": layers}
    )


def test_the_packed_decode_step_is_capture_safe(packed):
    model, spec, _ = packed
    assert capture_blocker(model, CPU, torch.float32) is None
    decode_under_guard(model, spec)


def test_without_the_setting_the_cpu_dequantises_at_load(checkpoint):
    model, _ = load_model(str(checkpoint[0]), torch.float32, CPU)
    for experts in stacks(model):
        assert experts.runner is None and experts.gate_up_proj.dtype == torch.float32
