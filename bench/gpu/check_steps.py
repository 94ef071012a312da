"""The Python steps of bench/gpu/check.sh.

    check_steps.py env                          versions and device, as JSON
    check_steps.py precompile NAME...           FlashInfer JIT builds (attention norm activation rope)
    check_steps.py results OUTDIR STATUS WALL_S  OUTDIR/results.json from everything check.sh left there
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def env() -> dict:
    t = time.perf_counter()
    import flashinfer
    import torch

    from engine.cuda import linear_attention

    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()
    return {
        "import_torch_and_flashinfer_s": time.perf_counter() - t, "flashinfer": flashinfer.__version__,
        "torch": torch.__version__, "cuda": torch.version.cuda, "device": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()), "nvcc": nvcc[-1] if nvcc else None,
        # fla (carried as a wheel) and the optional causal_conv1d: which kernels the hybrid models run here
        "gated_deltanet": linear_attention.describe(torch.device("cuda")),
    }


def precompile(names: list[str]) -> dict:
    """Head dims 64 (Qwen2.5-0.5B, SmolLM2, the tests) and 128 (Llama-3-8B) when names include attention."""
    sys.path.insert(0, str(ROOT))
    import torch

    from engine.cuda.kernels import precompile as build

    t = time.perf_counter()
    dims = [64, 128] if "attention" in names else []
    modules = build(dims, torch.bfloat16, tuple(n for n in names if n != "attention"))
    return {"jit_compile_s": time.perf_counter() - t, "modules": modules}


def junit(path: Path) -> dict:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        return {"missing": f"{type(exc).__name__}: {exc}"}
    suite = root if root.tag == "testsuite" else root[0]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["failed"] = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
                        if c.find("failure") is not None or c.find("error") is not None]
    return counts


def last_json_line(path: Path) -> dict:
    lines = path.read_text().strip().splitlines() if path.exists() else []
    if lines and lines[-1].startswith("{"):
        return json.loads(lines[-1])
    return {"log_tail": lines[-8:]}


def results(out: Path, status: dict, wall_s: int) -> dict:
    bench = {f.stem: json.loads(f.read_text()) for f in sorted((out / "bench").glob("*.json"))} \
        if (out / "bench").exists() else {}
    return {
        "wall_s": wall_s,
        "exit_status": status,
        "timed_out": sorted(k for k, v in status.items() if v in (124, 137)),
        "env": last_json_line(out / "env.json") if (out / "env.json").exists() else {},
        "jit": last_json_line(out / "jit.log"),
        "jit_slow": last_json_line(out / "jit-slow.log"),
        "tests": junit(out / "pytest.xml"),
        "tests_slow": junit(out / "pytest-slow.xml"),
        # the merged summary when bench.py got to write it, else whatever measurements finished
        "bench": bench.get("bench", {}).get("summary") or bench,
    }


def main() -> None:
    command, args = sys.argv[1], sys.argv[2:]
    if command == "env":
        print(json.dumps(env()))
    elif command == "precompile":
        print(json.dumps(precompile(args)))
    elif command == "results":
        out = Path(args[0])
        data = results(out, json.loads(args[1]), int(args[2]))
        (out / "results.json").write_text(json.dumps(data, indent=2))
        print(json.dumps(data, indent=2))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main()
