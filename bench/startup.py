"""Cold start of the worker: `handler.py --test_input <json>` to its first output and exit, and `handler.py --serve`
to ready (its log line) and to /health answering, each run a fresh process; and the fitness check of the model's
files (mode `checks`), which RunPod runs before the first job.

    python bench/startup.py --runs 5                                   this tree, the default bake
    python bench/startup.py --runs 5 --tree before=../old --tree after=.   two trees, runs alternating
    python bench/startup.py --model /path/to/bake --modes test_input,checks

The worker logs "start-up in ms: python .., settings .., imports .., weights .., ...; ready X s after the process
started" and "first output X s after the process started" (handler.py, counted from the process's start as /proc
gives it); this script reads those, adds the exit time and the first forward (first output - ready), and prints a
table. Trees alternate run by run so that a slow period of a shared machine falls on both sides. The model's files
are read once first (warm page cache) unless --cold-ok; --cold empties the whole page cache before every run
(root: /proc/sys/vm/drop_caches), so that the interpreter, torch and the weights are all read from disk as on a
fresh machine. Every run goes to bench/out/startup.json.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_INPUT = '{"prompt": "Hi", "sampling_params": {"max_tokens": 1, "temperature": 0}}'
STARTUP = re.compile(r"start-up in ms: (?P<phases>[^;]*); ready (?P<ready>[\d.]+) s")
FIRST = re.compile(r"first output (?P<first>[\d.]+) s")
# Variables a shell may carry that would make a run something other than a plain local start.
CLEARED = ("RUNPOD_WEBHOOK_GET_JOB", "RUNPOD_API_KEY", "MODEL_NAME", "BASE_PATH")


def warm(model: Path) -> float:
    """Read every file of the bake once, so each run finds it in the page cache; returns the GB read."""
    total = 0
    for path in sorted(model.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                while block := f.read(1 << 24):
                    total += len(block)
    return total / 1e9


def phases_of(log: str) -> dict[str, object]:
    """The start-up line's phases (ms) and ready (s), and the first output (s) when the log has it."""
    out: dict[str, object] = {}
    if m := STARTUP.search(log):
        for part in m.group("phases").split(", "):
            name, _, ms = part.rpartition(" ")
            out[name] = int(ms)
        out["ready_s"] = float(m.group("ready"))
    if m := FIRST.search(log):
        out["first_output_s"] = float(m.group("first"))
        if "ready_s" in out:
            out["first_forward_ms"] = round(1000 * (out["first_output_s"] - out["ready_s"]))
    return out


def env_for(model: Path, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(MODEL_PATH=str(model), PYTHONUNBUFFERED="1", **extra)
    return env


def run_test_input(tree: Path, model: Path, job: str, env: dict[str, str]) -> dict[str, object]:
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, str(tree / "handler.py"), "--test_input", job],
        cwd=tree,
        env=env_for(model, env),
        capture_output=True,
        text=True,
        timeout=600,
    )
    exit_s = time.perf_counter() - started
    if result.returncode != 0 or '"COMPLETED"' not in result.stdout:
        raise RuntimeError(f"{tree}: --test_input failed ({result.returncode}): {result.stderr[-2000:]}")
    return {**phases_of(result.stderr), "exit_s": round(exit_s, 2)}


CHECK_CODE = (
    "import sys, time; from worker.fitness import model_files_mismatch; t = time.perf_counter(); "
    "bad = model_files_mismatch(sys.argv[1]); print(round(1000 * (time.perf_counter() - t)), len(bad))"
)


def run_checks(tree: Path, model: Path) -> dict[str, object]:
    """The fitness check of the model's files as the tree runs it by default (RunPod runs it before the first
    job; --test_input and --serve do not)."""
    result = subprocess.run(
        [sys.executable, "-c", CHECK_CODE, str(model)],
        cwd=tree,
        env=env_for(model, {}),
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    ms, bad = result.stdout.split()
    return {"file check ms": int(ms), "files failing": int(bad)}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_serve(tree: Path, model: Path, env: dict[str, str], log_path: Path) -> dict[str, object]:
    """`--serve` until /health answers 200; the time to that is the bench's clock from just before the spawn."""
    port = free_port()
    started = time.perf_counter()
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, str(tree / "handler.py"), "--serve", "--port", str(port)],
            cwd=tree,
            env=env_for(model, env),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{tree}: --serve exited {process.returncode}: {log_path.read_text()[-2000:]}")
            if time.perf_counter() - started > 600:
                raise RuntimeError(f"{tree}: --serve not healthy within 600 s")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(0.02)
        health_s = time.perf_counter() - started
    finally:
        process.terminate()
        process.wait(timeout=60)
    return {**phases_of(log_path.read_text()), "health_s": round(health_s, 2)}


def drop_page_cache() -> None:
    """Writes back dirty pages and drops the clean ones (all files, not only the bake's)."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
    except OSError as exc:
        raise SystemExit(f"--cold needs to write /proc/sys/vm/drop_caches (root): {exc}") from exc


def load_average() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return -1.0


def wait_quiet(limit: float, below: float) -> None:
    """Wait up to `limit` s for the 1-minute load average to drop below `below` (a shared machine skews every
    figure; the load each run started at is in its row)."""
    deadline = time.monotonic() + limit
    while load_average() >= below and time.monotonic() < deadline:
        time.sleep(5)


def table(rows: list[dict[str, object]]) -> str:
    """One line per run, in the order they ran."""
    names: list[str] = []
    for row in rows:
        names += [k for k in row if k not in names and k not in ("tree", "mode", "run", "load")]
    head = ["run", "tree", "mode", "load 1 min", *names]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [row["run"], row["tree"], row["mode"], row["load"], *(row.get(n, "") for n in names)]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", default=[], help="LABEL=PATH of a checkout (default: this one)")
    parser.add_argument("--model", type=Path, default=ROOT / ".models" / "model", help="the bake (MODEL_PATH)")
    parser.add_argument("--modes", default="test_input,serve")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--job", default=DEFAULT_INPUT, help="the --test_input JSON")
    parser.add_argument("--env", action="append", default=[], help="NAME=VALUE for the worker (e.g. DTYPE=float32)")
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        help="before each run, wait up to this many seconds for the load average to drop below --quiet-below",
    )
    parser.add_argument("--quiet-below", type=float, default=0.5)
    parser.add_argument("--cold-ok", action="store_true", help="do not read the bake first")
    parser.add_argument("--cold", action="store_true", help="drop the page cache before every run (root)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "startup.json")
    args = parser.parse_args()

    trees = [(label, Path(path).resolve()) for label, _, path in (t.partition("=") for t in args.tree)] or [
        ("this", ROOT)
    ]
    env = dict(e.split("=", 1) for e in args.env)
    model = args.model.resolve()
    if not (args.cold_ok or args.cold):
        print(f"read {warm(model):.2f} GB of {model.name} to warm the page cache", file=sys.stderr)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, object]] = []
    for run in range(1, args.runs + 1):
        for mode in args.modes.split(","):
            for label, tree in trees:  # alternating: each tree once per run and mode
                wait_quiet(args.wait_quiet, args.quiet_below)
                if args.cold:
                    drop_page_cache()
                load = load_average()
                if mode == "test_input":
                    figures = run_test_input(tree, model, args.job, env)
                elif mode == "checks":
                    figures = run_checks(tree, model)
                else:
                    figures = run_serve(tree, model, env, args.out.parent / f"startup-{label}.log")
                rows.append({"run": run, "tree": label, "mode": mode, "load": load, **figures})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    args.out.write_text(json.dumps({"model": model.name, "env": env, "cold": args.cold, "runs": rows}, indent=1) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
