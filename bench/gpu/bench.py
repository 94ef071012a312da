"""GPU benchmark: our engine (FlashInfer, CUDA graphs) against transformers generate, on random-weight models
of Qwen2.5-0.5B's and Llama-3-8B's shapes built from their configs (no download).

    python bench/gpu/bench.py all --out OUTDIR [--shapes qwen2.5-0.5b llama3-8b]

Each measurement runs in its own process (clean GPU memory, honest start-up times) and writes
OUTDIR/<name>.json; `all` merges them into OUTDIR/bench.json. Reported per shape: start-up to first token,
batch-1 decode tok/s and its share of the measured HBM copy bandwidth, output tok/s at 64 and 256
concurrent requests (256 prompt tokens, 256 output tokens, ignore_eos), the same for transformers.
"""

from __future__ import annotations

import time

T_PROCESS = time.perf_counter()  # start-up is measured from here, before torch is imported

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
# NOTE: run as a script, this folder heads sys.path and `import bench` would find this very file.
sys.path[:] = [str(ROOT)] + [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
PROMPT_LEN, OUTPUT_LEN, CONCURRENCY = 256, 256, (64, 256)


def save(out: Path, name: str, data: dict) -> None:
    (out / f"{name}.json").write_text(json.dumps(data, indent=2))
    print(json.dumps({name: data}), flush=True)


def copy_bandwidth(out: Path) -> None:
    """Device-to-device copy of a 4 GiB buffer; bytes read + written per second (the HBM roofline here)."""
    import torch

    n = 4 << 30
    src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / 20
    save(
        out,
        "bandwidth",
        {
            "copy_bytes": n,
            "copy_TBps": 2 * n / seconds / 1e12,
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
        },
    )


def make_checkpoint(shape: str, path: Path) -> None:
    from bench.gpu.random_model import SHAPES, make_config, save_random_checkpoint

    fields = dict(SHAPES[shape])
    t = time.perf_counter()
    save_random_checkpoint(make_config(fields.pop("kind"), **fields), path)
    print(f"checkpoint {shape} written to {path} in {time.perf_counter() - t:.1f}s", flush=True)


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n, PROMPT_LEN), generator=g).tolist()


def run_engine(shape: str, ckpt: Path, out: Path) -> None:
    import torch

    from engine.config import EngineConfig
    from engine.core.engine import LLMEngine
    from engine.sample.params import SamplingParams

    t_import = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            model_path=str(ckpt),
            device="cuda",
            dtype="bfloat16",
            attention_backend="flashinfer",
            max_num_seqs=max(CONCURRENCY),
            max_num_batched_tokens=8192,
            enable_prefix_caching=False,
        )
    )
    t_init = time.perf_counter()
    vocab = engine.spec.vocab_size
    greedy = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)

    # Start-up: the first request's first token, then its second (a decode kernel compiled late shows here).
    engine.add_request("first", prompts(1, vocab, 0)[0], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    stamps = []
    while engine.has_unfinished():
        if engine.step():
            stamps.append(time.perf_counter())
    result = {
        "describe": {k: v for k, v in engine.describe().items() if isinstance(v, (int, float, str, bool))},
        "import_s": t_import - T_PROCESS,
        "engine_init_s": t_init - t_import,
        "startup_to_first_token_s": stamps[0] - T_PROCESS,
        "second_token_s": stamps[1] - stamps[0],
    }

    # Batch-1 decode: tokens after the first, over the time after the first.
    engine.add_request("b1", prompts(1, vocab, 1)[0], greedy)
    stamps = []
    while engine.has_unfinished():
        for o in engine.step():
            stamps += [time.perf_counter()] * sum(len(d.token_ids) for d in o.outputs)
    tok_s = (len(stamps) - 1) / (stamps[-1] - stamps[0])
    weights = weight_bytes_read_per_step(engine.model)
    s = engine.spec
    kv_token = 2 * s.num_layers * s.num_kv_heads * s.head_dim * 2  # bf16 K and V of one token
    bytes_per_step = weights + kv_token * (PROMPT_LEN + OUTPUT_LEN // 2)  # weights + the average KV read
    result["batch1"] = {
        "decode_tok_s": tok_s,
        "weight_bytes": weights,
        "bytes_per_step": bytes_per_step,
        "achieved_TBps": tok_s * bytes_per_step / 1e12,
    }

    for n in CONCURRENCY:
        batch = prompts(n, vocab, 100 + n)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i, p in enumerate(batch):
            engine.add_request(f"c{n}-{i}", p, greedy)
        generated, first = 0, None
        while engine.has_unfinished():
            for o in engine.step():
                generated += sum(len(d.token_ids) for d in o.outputs)
                first = first or time.perf_counter()
        elapsed = time.perf_counter() - t0
        assert generated == n * OUTPUT_LEN, (generated, n * OUTPUT_LEN)
        result[f"concurrent_{n}"] = {
            "output_tok_s": generated / elapsed,
            "elapsed_s": elapsed,
            "first_output_s": first - t0,
        }
    graphs = getattr(getattr(engine, "runner", None), "graph_runner", None)
    if graphs is not None:
        result["cuda_graphs"] = {
            "batch_sizes": graphs.batch_sizes,
            "replays": graphs.replays,
            "eager_fallbacks": graphs.eager_fallbacks,
        }
    result["peak_allocated_GiB"] = torch.cuda.max_memory_allocated() / 2**30
    save(out, f"engine-{shape}", result)


def weight_bytes_read_per_step(model) -> int:
    """Every weight is read once per decode step, except the input embedding table (a row per token),
    which counts only when it doubles as the output projection (tied)."""
    tensors = {id(t): t for t in list(model.parameters()) + list(model.buffers())}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    return total if embed is head else total - embed.numel() * embed.element_size()


def run_transformers(shape: str, ckpt: Path, out: Path) -> None:
    import torch
    import transformers as tf

    t0 = time.perf_counter()
    model = tf.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.bfloat16).cuda().eval()
    vocab = model.config.vocab_size
    result = {
        "load_s": time.perf_counter() - t0,
        "transformers": tf.__version__,
        "attn_implementation": model.config._attn_implementation,
    }

    def generate(ids: list[list[int]], new_tokens: int) -> float:
        x = torch.tensor(ids, device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        torch.cuda.synchronize()
        return time.perf_counter() - t

    generate(prompts(2, vocab, 0), 8)  # warm-up: cuBLAS handles, allocator
    one = prompts(1, vocab, 1)
    prefill = generate(one, 1)
    full = generate(one, OUTPUT_LEN)
    result["batch1"] = {"decode_tok_s": (OUTPUT_LEN - 1) / (full - prefill)}
    for n in CONCURRENCY:
        elapsed = generate(prompts(n, vocab, 100 + n), OUTPUT_LEN)
        result[f"concurrent_{n}"] = {"output_tok_s": n * OUTPUT_LEN / elapsed, "elapsed_s": elapsed}
    save(out, f"transformers-{shape}", result)


def run_all(shapes: list[str], out: Path, ckpt_dir: Path, peer: bool) -> None:
    """Each step in a subprocess; a failed step is recorded and the rest still run."""
    me = [sys.executable, str(Path(__file__).resolve())]
    steps: list[tuple[str, list[str]]] = [("bandwidth", ["bandwidth"])]
    for shape in shapes:
        ckpt = ckpt_dir / shape
        steps += [
            (f"checkpoint-{shape}", ["checkpoint", shape, str(ckpt)]),
            (f"engine-{shape}", ["engine", shape, str(ckpt)]),
        ]
        if peer:
            steps.append((f"transformers-{shape}", ["transformers", shape, str(ckpt)]))
    errors = {}
    for name, args in steps:
        print(f"== {name}", flush=True)
        rc = subprocess.call(me + args + ["--out", str(out)])
        if rc != 0:
            errors[name] = f"exit status {rc}"
        if name.startswith("transformers-") or (not peer and name.startswith("engine-")):
            shutil.rmtree(ckpt_dir / name.split("-", 1)[1], ignore_errors=True)  # 16 GB for the 8B
    merged = {"errors": errors}
    for f in sorted(out.glob("*.json")):
        if f.stem in ("bandwidth",) or f.stem.startswith(("engine-", "transformers-")):
            merged[f.stem] = json.loads(f.read_text())
    merged["summary"] = summarize(merged, shapes)
    (out / "bench.json").write_text(json.dumps(merged, indent=2))
    print(json.dumps(merged["summary"], indent=2))


def summarize(merged: dict, shapes: list[str]) -> dict:
    bw = merged.get("bandwidth", {}).get("copy_TBps")
    summary: dict = {"copy_TBps": bw}
    for shape in shapes:
        ours, peer = merged.get(f"engine-{shape}", {}), merged.get(f"transformers-{shape}", {})
        row: dict = {}
        if ours:
            row["startup_to_first_token_s"] = ours["startup_to_first_token_s"]
            row["batch1_decode_tok_s"] = ours["batch1"]["decode_tok_s"]
            if bw:
                row["batch1_fraction_of_copy_bandwidth"] = ours["batch1"]["achieved_TBps"] / bw
            for n in CONCURRENCY:
                row[f"output_tok_s_{n}"] = ours[f"concurrent_{n}"]["output_tok_s"]
        if peer:
            row["transformers_batch1_decode_tok_s"] = peer["batch1"]["decode_tok_s"]
            for n in CONCURRENCY:
                row[f"transformers_output_tok_s_{n}"] = peer[f"concurrent_{n}"]["output_tok_s"]
                if ours:
                    row[f"speedup_{n}"] = row[f"output_tok_s_{n}"] / row[f"transformers_output_tok_s_{n}"]
        summary[shape] = row
    return summary


def default_checkpoint_dir() -> Path:
    if "BENCH_CKPT_DIR" in os.environ:
        return Path(os.environ["BENCH_CKPT_DIR"])
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and shutil.disk_usage(shm).free > 20 << 30 else Path("/tmp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["all", "bandwidth", "checkpoint", "engine", "transformers"])
    parser.add_argument("args", nargs="*")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shapes", nargs="+", default=["qwen2.5-0.5b", "llama3-8b"])
    parser.add_argument(
        "--checkpoints",
        type=Path,
        default=default_checkpoint_dir(),
        help="where the random checkpoints are written (RAM-backed when it has room)",
    )
    parser.add_argument("--no-peer", action="store_true", help="skip transformers")
    a = parser.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    if a.command == "all":
        run_all(a.shapes, a.out, a.checkpoints / "bench-ckpt", not a.no_peer)
    elif a.command == "bandwidth":
        copy_bandwidth(a.out)
    elif a.command == "checkpoint":
        make_checkpoint(a.args[0], Path(a.args[1]))
    elif a.command == "engine":
        run_engine(a.args[0], Path(a.args[1]), a.out)
    elif a.command == "transformers":
        run_transformers(a.args[0], Path(a.args[1]), a.out)


if __name__ == "__main__":
    main()
