"""The Python steps of bench/gpu/check.sh.

    check_steps.py env                            versions and device, as JSON
    check_steps.py modules                        the FlashInfer modules tests/gpu needs, one name a line
    check_steps.py build [--missing]              builds them (all, or those neither carried nor built), one ninja
    check_steps.py unpack ARCHIVE                 a carried archive of built modules -> FlashInfer's AOT folder
                                                  (CHECK_AOT_DIR when set: the one of check.sh's private install)
    check_steps.py pack ARCHIVE                   the built modules of `modules` -> a carried archive (tar.xz)
    check_steps.py plan                           needed against carried and built, as JSON
    check_steps.py results OUTDIR STATUS WALL_S   OUTDIR/results.json from everything check.sh left there

Carried modules go where FlashInfer looks before it JITs: its AOT folder (flashinfer/data/aot/<name>/<name>.so in
the installed package, FLASHINFER_AOT_DIR), which it loads without running ninja; built ones land in the JIT cache
(FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/<version>/<arch>/cached_ops).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
BF16, FP8 = "bfloat16", "float8_e4m3fn"


def gpu_test_modules() -> list:
    """What tests/gpu plans, outside -m slow, read off its shapes (q heads / KV heads >= 4: tensor-core decode, which
    is the prefill module): attention (64 and 128, GQA 1 to 7, windows, sinks, Gemma's soft-cap at 256, FP8 pages),
    graphs and end-to-end on tiny Llamas of head size 64 (8/2 and 6/2 heads), the hybrid Qwen3.5 (64), a sliding
    group of 256 beside the 512 one the torch backend takes, and FlashInfer's MLA kernel at DeepSeek's latent."""
    from engine.cuda.precompile import AttentionModule as M

    return [
        M(kind="prefill", head_dim=64, q_dtype=BF16, kv_dtype=BF16, sliding_window=False),
        M(kind="decode", head_dim=64, q_dtype=BF16, kv_dtype=BF16, sliding_window=False),
        M(kind="prefill", head_dim=64, q_dtype=BF16, kv_dtype=BF16, sliding_window=True),
        M(kind="prefill", head_dim=128, q_dtype=BF16, kv_dtype=BF16, sliding_window=False),
        M(kind="prefill", head_dim=64, q_dtype=BF16, kv_dtype=FP8, sliding_window=False),
        M(kind="sink", head_dim=64, q_dtype=BF16, kv_dtype=BF16, sliding_window=False),
        M(kind="sink", head_dim=64, q_dtype=BF16, kv_dtype=BF16, sliding_window=True),
        M(kind="sink", head_dim=128, q_dtype=BF16, kv_dtype=BF16, sliding_window=False),
        M(kind="sink", head_dim=128, q_dtype=BF16, kv_dtype=BF16, sliding_window=True),
        M(kind="prefill", head_dim=256, q_dtype=BF16, kv_dtype=BF16, sliding_window=False, soft_cap=True),
        M(kind="decode", head_dim=256, q_dtype=BF16, kv_dtype=BF16, sliding_window=False, soft_cap=True),
        M(kind="prefill", head_dim=256, q_dtype=BF16, kv_dtype=BF16, sliding_window=True, soft_cap=True),
        # test_gpu_group_backends: a Gemma-4-like sliding group of 256 (4 q heads on 2) warmed up beside a 512 one
        M(kind="prefill", head_dim=256, q_dtype=BF16, kv_dtype=BF16, sliding_window=True),
        M(kind="decode", head_dim=256, q_dtype=BF16, kv_dtype=BF16, sliding_window=True),
        # test_gpu_mla: DeepSeek's latent (512 + 64), prefill and decode in one module
        M(kind="mla", head_dim=512, rope_dim=64, q_dtype=BF16, kv_dtype=BF16, sliding_window=False),
    ]


def needed_names() -> list[str]:
    from engine.cuda.precompile import module_names

    return module_names(gpu_test_modules())


def aot_dir() -> Path:
    """check.sh's CHECK_AOT_DIR (the AOT folder of the flashinfer it installed), else the imported flashinfer's."""
    if os.environ.get("CHECK_AOT_DIR"):
        return Path(os.environ["CHECK_AOT_DIR"])
    from flashinfer.jit import env as jit_env

    return Path(jit_env.FLASHINFER_AOT_DIR)


def found_libraries() -> dict[str, str]:
    """name -> where its library is: "carried" (the AOT folder) or "built" (this arch's JIT cache)."""
    from flashinfer.jit import env as jit_env

    found = {p.parent.name: "built" for p in Path(jit_env.FLASHINFER_JIT_DIR).glob("*/*.so")}
    found |= {p.parent.name: "carried" for p in aot_dir().glob("*/*.so")}
    return found


def plan() -> dict:
    from flashinfer.jit import env as jit_env

    needed, found = needed_names(), found_libraries()
    return {
        "needed": len(needed),
        "carried": sorted(n for n in needed if found.get(n) == "carried"),
        "built": sorted(n for n in needed if found.get(n) == "built"),
        "missing": sorted(n for n in needed if n not in found),
        "aot_dir": str(aot_dir()),
        # False in a dry run whose Python cannot import the carried wheels (it lists, it does not load)
        "flashinfer_loads_from_it": Path(jit_env.FLASHINFER_AOT_DIR) == aot_dir(),
    }


def build(missing_only: bool) -> dict:
    """One ninja over what tests/gpu needs (MAX_JOBS at a time), so that no test compiles."""
    from engine.cuda.precompile import KERNEL_MODULES, jit_specs
    from engine.cuda.precompile import build as build_specs

    start = time.perf_counter()
    wanted = set(plan()["missing"]) if missing_only else set(needed_names())
    specs = [s for s in jit_specs(gpu_test_modules(), KERNEL_MODULES) if s.name in wanted]
    build_specs(specs)
    return {"jit_compile_s": time.perf_counter() - start, "modules": [s.name for s in specs]}


def pack(archive: Path) -> dict:
    """The libraries of needed_names(), built or carried, as <name>/<name>.so in an xz tar (what unpack() puts in
    the AOT folder)."""
    from flashinfer.jit import env as jit_env

    folders = {"built": Path(jit_env.FLASHINFER_JIT_DIR), "carried": aot_dir()}
    found = found_libraries()
    absent = [n for n in needed_names() if n not in found]
    if absent:
        raise SystemExit(f"not built (run `check_steps.py build` first): {absent}")
    libraries = [folders[found[n]] / n / f"{n}.so" for n in needed_names()]
    archive.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive, "w:xz", preset=9) as tar:
        for path in libraries:
            tar.add(path, arcname=f"{path.parent.name}/{path.name}")
    return {
        "archive": str(archive),
        "bytes": archive.stat().st_size,
        "modules": len(libraries),
        "library_bytes": sum(p.stat().st_size for p in libraries),
    }


def unpack(archive: Path) -> dict:
    start = time.perf_counter()
    target = aot_dir()
    target.mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        tar.extractall(target, filter="data")
        names = sorted({Path(m.name).parts[0] for m in tar.getmembers() if m.isfile()})
    return {"unpack_s": time.perf_counter() - start, "aot_dir": str(target), "modules": names}


def env() -> dict:
    t = time.perf_counter()
    import flashinfer
    import torch

    from engine.cuda import linear_attention

    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    return {
        "import_torch_and_flashinfer_s": time.perf_counter() - t,
        "flashinfer": flashinfer.__version__,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "nvcc": nvcc[-1] if nvcc else None,
        # fla (carried as a wheel) and the optional causal_conv1d: which kernels the hybrid models run here
        "gated_deltanet": linear_attention.describe(torch.device("cuda")),
    }


def junit(path: Path) -> dict:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        return {"missing": f"{type(exc).__name__}: {exc}"}
    suite = root if root.tag == "testsuite" else root[0]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["failed"] = [
        f"{c.get('classname')}::{c.get('name')}"
        for c in suite.iter("testcase")
        if c.find("failure") is not None or c.find("error") is not None
    ]
    return counts


def last_json_line(path: Path) -> dict:
    lines = path.read_text().strip().splitlines() if path.exists() else []
    if lines and lines[-1].startswith("{"):
        return json.loads(lines[-1])
    return {"log_tail": lines[-8:]}


def results(out: Path, status: dict, wall_s: int) -> dict:
    bench = (
        {f.stem: json.loads(f.read_text()) for f in sorted((out / "bench").glob("*.json"))}
        if (out / "bench").exists()
        else {}
    )
    return {
        "wall_s": wall_s,
        "exit_status": status,
        "timed_out": sorted(k for k, v in status.items() if v in (124, 137)),
        "env": last_json_line(out / "env.json") if (out / "env.json").exists() else {},
        "modules": {
            name: last_json_line(out / f"{name}.log")
            for name in ("unpack", "plan", "jit")
            if (out / f"{name}.log").exists()
        },
        # one junit file per test group, in the order they ran (pytest-<group>.xml)
        "tests": {
            f.stem.removeprefix("pytest-"): junit(f)
            for f in sorted(out.glob("pytest-*.xml"), key=lambda f: f.stat().st_mtime)
        },
        "collected": last_json_line(out / "collect.log") if (out / "collect.log").exists() else {},
        # the merged summary when bench.py got to write it, else whatever measurements finished
        "bench": bench.get("bench", {}).get("summary") or bench,
    }


def main() -> None:
    command, args = sys.argv[1], sys.argv[2:]
    if command == "env":
        print(json.dumps(env()))
    elif command == "modules":
        print("\n".join(needed_names()))
    elif command == "build":
        print(json.dumps(build(missing_only="--missing" in args)))
    elif command == "pack":
        print(json.dumps(pack(Path(args[0]))))
    elif command == "unpack":
        print(json.dumps(unpack(Path(args[0]))))
    elif command == "plan":
        print(json.dumps(plan()))
    elif command == "results":
        out = Path(args[0])
        data = results(out, json.loads(args[1]), int(args[2]))
        (out / "results.json").write_text(json.dumps(data, indent=2))
        print(json.dumps(data, indent=2))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
