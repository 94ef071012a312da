"""Kernel dispatch in the model (torch on CPU, FlashInfer wiring chosen once) and engine.cuda.setup's pure rules.

On CPU the fused wiring still runs end to end: engine.cuda.kernels falls back to torch for CPU tensors, so a model
switched to the fused path (init_rotary(fused=True)) exercises exactly the CUDA data flow (positions down to
every layer, the float32 cos|sin table, in-place fused add+norm, q/k views) and must give the same logits.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.attention import resolve_backend
from engine.attention.torch_ref import TorchRefBackend
from engine.core.cuda_graphs import prepare_cuda
from engine.cuda import kernels
from engine.cuda import setup as cuda_setup
from engine.errors import StartupError
from engine.model.layers.norm import RMSNorm
from engine.model.loader import load_model
from engine.model.models.llama import LlamaArgs, LlamaAttention, LlamaMLP

GiB = 1 << 30
ROOT = Path(__file__).resolve().parents[3]


def load(tiny_checkpoint, tmp_path, kind: str):
    tiny_checkpoint(kind, tmp_path)
    return load_model(str(tmp_path), torch.float32, torch.device("cpu"))


def modules_of(model, cls):
    return [m for m in model.modules() if isinstance(m, cls)]


def test_cpu_model_takes_the_torch_path(tiny_checkpoint, tmp_path):
    model, _ = load(tiny_checkpoint, tmp_path, "qwen3")
    assert model.fused_kernels is False
    norms = modules_of(model, RMSNorm)
    assert len(norms) == 2 * 2 + 2 * 2 + 1  # per layer: input/post norms and q/k norms; the final norm
    assert not any(n.fused for n in norms)
    assert not any(m.fused for m in modules_of(model, LlamaMLP))
    assert all(a.cos_sin_cache is None for a in modules_of(model, LlamaAttention))
    assert model.rotary.cos is not None and model.rotary.cos_sin_cache is None


def test_use_fused_kernels_rule(monkeypatch):
    monkeypatch.setattr(kernels, "flashinfer_available", lambda: True)
    assert kernels.use_fused_kernels(torch.device("cuda"), torch.bfloat16)
    assert kernels.use_fused_kernels(torch.device("cuda", 1), torch.float16)
    assert not kernels.use_fused_kernels(torch.device("cuda"), torch.float32)
    assert not kernels.use_fused_kernels(torch.device("cpu"), torch.bfloat16)
    monkeypatch.setattr(kernels, "flashinfer_available", lambda: False)
    assert not kernels.use_fused_kernels(torch.device("cuda"), torch.bfloat16)


def run(model, spec, paged_harness, steps):
    harness = paged_harness(num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim)
    backend = TorchRefBackend("cpu")
    out = []
    with torch.inference_mode():
        for batch in steps:
            input_ids, positions, meta = harness.step(batch)
            backend.plan(meta)
            out.append(model.compute_logits(model(input_ids, positions, meta, harness.kv_caches, backend)))
    return out


@pytest.mark.parametrize("kind", ["llama", "llama3_rope", "qwen3"])
def test_fused_wiring_gives_the_torch_logits(tiny_checkpoint, paged_harness, tmp_path, kind):
    model, spec = load(tiny_checkpoint, tmp_path, kind)
    steps = [[("a", [5, 9, 77, 3, 1, 8, 100]), ("b", [42])], [("a", [7]), ("b", [11])], [("b", [2, 3, 4]), ("a", [6])]]
    want = run(model, spec, paged_harness, steps)

    model.init_rotary(spec.max_position_embeddings, torch.float32, torch.device("cpu"), fused=True)
    assert model.fused_kernels and all(n.fused for n in modules_of(model, RMSNorm))
    assert all(m.fused for m in modules_of(model, LlamaMLP))
    table = model.rotary.cos_sin_cache
    assert table.dtype == torch.float32 and table.shape == (spec.max_position_embeddings, spec.head_dim)
    assert all(a.cos_sin_cache is table for a in modules_of(model, LlamaAttention))
    got = run(model, spec, paged_harness, steps)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)

    model.init_rotary(spec.max_position_embeddings, torch.float32, torch.device("cpu"))  # back to auto: torch
    assert not model.fused_kernels and model.rotary.cos_sin_cache is None
    for g, w in zip(run(model, spec, paged_harness, steps), want, strict=True):
        assert torch.equal(g, w)


def test_resolve_backend_rules(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(kernels, "flashinfer_import_error", lambda: None)
    assert resolve_backend("auto", cuda, torch.bfloat16) == ("flashinfer", "auto: CUDA")
    assert resolve_backend("auto", cuda, torch.float16)[0] == "flashinfer"
    assert resolve_backend("flashinfer", cuda, torch.bfloat16) == ("flashinfer", "asked for")
    assert resolve_backend("auto", cuda, torch.float32) == ("torch", "auto: FlashInfer has no float32 kernels")
    assert resolve_backend("auto", cpu, torch.bfloat16) == ("torch", "auto: cpu")
    assert resolve_backend("torch", cuda, torch.bfloat16) == ("torch", "asked for")
    for asked, device, dtype, says in [
        ("flashinfer", cuda, torch.float32, "no float32 kernels"),
        ("flashinfer", cpu, torch.bfloat16, "needs CUDA"),
        ("fast", cuda, torch.bfloat16, "unknown attention backend 'fast'"),
    ]:
        with pytest.raises(StartupError, match=says) as err:
            resolve_backend(asked, device, dtype)
        assert err.value.param == "attention_backend"


BROKEN_FLASHINFER = "raise OSError('libcudart.so.13: cannot open shared object file')\n"
RESOLVE = """
import torch
from engine.attention import resolve_backend
from engine.errors import StartupError
for asked in ("auto", "flashinfer", "torch"):
    try:
        print(asked, "->", resolve_backend(asked, torch.device("cuda"), torch.bfloat16))
    except StartupError as exc:
        print(asked, "-> StartupError:", exc)
"""


def test_a_flashinfer_that_fails_to_import_on_cuda_stops_start_up_with_its_cause(tmp_path):
    """A real import failure (a flashinfer package whose import raises, as a broken CUDA build does): auto and
    flashinfer refuse with the cause and the way out; only an explicit torch gets the torch backend."""
    (tmp_path / "flashinfer").mkdir()
    (tmp_path / "flashinfer" / "__init__.py").write_text(BROKEN_FLASHINFER)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    done = subprocess.run([sys.executable, "-c", RESOLVE], env=env, capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for line in lines[:2]:
        assert "StartupError: FlashInfer does not import on this CUDA machine (OSError: libcudart.so.13" in line
        assert "requirements-cuda.txt" in line and "attention_backend=torch" in line
    assert lines[2] == "torch -> ('torch', 'asked for')"


def test_backend_kwargs(tiny_checkpoint, tmp_path):
    _, spec = load(tiny_checkpoint, tmp_path, "llama")
    kw = cuda_setup.backend_kwargs(spec, torch.bfloat16)
    assert kw == dict(num_q_heads=4, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    TorchRefBackend("cpu", **kw)  # every backend takes them


def test_kv_budget_arithmetic():
    # 100 GiB card, 20 GiB in use (weights, workspace, context), 90 %, 2 GiB reserve -> 68 GiB for KV
    assert cuda_setup.kv_budget_from(80 * GiB, 100 * GiB, 0.9, 2 * GiB) == 68 * GiB
    assert cuda_setup.kv_budget_from(80 * GiB, 100 * GiB, 1.0, 0) == 80 * GiB
    assert cuda_setup.kv_budget_from(5 * GiB, 100 * GiB, 0.5, GiB) == 0  # over budget already: never negative
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(StartupError) as err:
            cuda_setup.kv_budget_from(80 * GiB, 100 * GiB, bad, 0)
        assert err.value.param == "gpu_memory_utilization"


def llama8b_args() -> LlamaArgs:
    return LlamaArgs(
        hidden_size=4096,
        intermediate_size=14336,
        num_layers=32,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=128256,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
    )


def test_reserve_bytes_covers_activations_sampler_and_graphs():
    a = llama8b_args()

    def reserve(**kw):
        base = dict(max_num_batched_tokens=2048, max_num_seqs=256, max_pages_per_seq=512, graphs=True)
        return cuda_setup.reserve_bytes(a, torch.bfloat16, **{**base, **kw})

    eager = reserve(graphs=False)
    # at least the sampler's fp32 logits of 256 rows, twice over, and the explicit slack
    assert eager >= 2 * 256 * a.vocab_size * 4 + cuda_setup.SLACK_BYTES
    assert reserve() > eager  # graphs cost memory
    assert reserve(max_num_batched_tokens=8192) > reserve()
    assert reserve(max_pages_per_seq=8192) > reserve()
    assert 0.5 * GiB < reserve() < 4 * GiB  # a sane fraction of a GPU for the 8B shape
    # smaller batches: fewer captured sizes, fewer logit rows (down to the prompt-logprobs slice)
    assert reserve(max_num_seqs=8) < reserve()


def test_reserve_bytes_covers_a_hybrid_decode_s_gathered_states():
    """Qwen3.5's 32 value heads of 128 x 128 (held with their log-scale row): two float32 copies of every row's
    state, eager and in the graphs."""
    from engine.model.layers.gated_deltanet import DeltaNetShape

    a = llama8b_args()
    hybrid = SimpleNamespace(
        **vars(a),
        deltanet=DeltaNetShape(
            hidden_size=4096, num_k_heads=16, num_v_heads=32, head_k_dim=128, head_v_dim=128, conv_kernel=4, eps=1e-6
        ),
    )
    base = dict(max_num_batched_tokens=2048, max_num_seqs=64, max_pages_per_seq=512)
    state = 2 * 4 * 32 * 129 * 128
    for graphs, rows in ((False, 64), (True, 128)):
        extra = cuda_setup.reserve_bytes(hybrid, torch.bfloat16, graphs=graphs, **base) - cuda_setup.reserve_bytes(
            a, torch.bfloat16, graphs=graphs, **base
        )
        assert extra == rows * state


def test_graph_batch_sizes():
    assert cuda_setup.graph_batch_sizes(3) == [1, 2, 3]
    sizes = cuda_setup.graph_batch_sizes(1000)
    assert sizes[-1] == cuda_setup.MAX_GRAPH_BATCH and sizes[:5] == [1, 2, 4, 8, 16]


def test_prepare_cuda_without_a_graph_backend_runs_eagerly(tiny_checkpoint, paged_harness, tmp_path):
    model, spec = load(tiny_checkpoint, tmp_path, "llama")
    harness = paged_harness(num_layers=spec.num_layers, num_kv_heads=spec.num_kv_heads, head_dim=spec.head_dim)
    for eager in (True, False):
        runner = prepare_cuda(
            model,
            TorchRefBackend("cpu"),
            harness.kv_caches,
            page_size=4,
            max_num_seqs=8,
            max_model_len=128,
            enforce_eager=eager,
        )
        assert runner is None
