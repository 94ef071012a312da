"""The worker layer imports without torch: the RunPod/OpenAI code must not pull the engine's heavy stack
(torch, transformers) in at import time, so that the engine's loading can overlap the worker's imports. And it
has one door each to the environment (worker/settings.py) and to the engine (AsyncEngine's public methods)."""

from __future__ import annotations

import ast
import subprocess
import sys

from local_worker import ROOT

CODE = """
import sys
import worker.jobs, worker.server, worker.native, worker.runtime, worker.settings
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
print(",".join(heavy))
"""


def test_importing_the_worker_layer_loads_no_torch() -> None:
    result = subprocess.run([sys.executable, "-c", CODE], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"importing worker/ loaded {result.stdout.strip()}"


def worker_sources() -> list:
    return [ROOT / "handler.py", *sorted((ROOT / "worker").rglob("*.py"))]


def test_only_settings_reads_the_environment() -> None:
    readers = []
    for path in worker_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr in ("environ", "getenv")
                and isinstance(node.value, ast.Name)
                and node.value.id == "os"
            ):
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert readers and all(r.startswith("worker/settings.py:") for r in readers), readers


def test_the_worker_reaches_the_engine_only_through_async_engine_methods() -> None:
    """No `<runtime>.engine.engine` (the AsyncEngine's LLMEngine) and no private engine attributes."""
    inside = []
    for path in worker_sources():
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute)
                and node.value.attr == "engine"
                and (node.attr == "engine" or node.attr.startswith("_"))
            ):
                inside.append(f"{path.relative_to(ROOT)}:{node.lineno} .engine.{node.attr}")
    assert not inside, inside


def test_the_runtime_has_what_the_routes_ask_of_it() -> None:
    """worker/openai and worker/anthropic take a worker.openai.runtime.Runtime (a protocol, so they need not
    import worker/runtime.py back); the runtime start() builds has every member of it."""
    import typing

    import worker.runtime
    from worker.openai.runtime import Runtime as Asked

    asked = {
        n
        for n in (
            *typing.get_type_hints(
                Asked, localns={"Settings": object, "ResponseStore": object, "RedisResponseStore": object}
            ),
            *vars(Asked),
        )
        if not n.startswith("_")
    }
    built = worker.runtime.Runtime
    missing = sorted(n for n in asked if not hasattr(built, n) and n not in built.__dataclass_fields__)
    assert not missing, missing
