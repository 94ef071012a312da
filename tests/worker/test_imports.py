"""The worker layer imports without torch: the RunPod/OpenAI code must not pull the engine's heavy stack
(torch, transformers) in at import time, so that the engine's loading can overlap the worker's imports."""

from __future__ import annotations

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
