"""bench/gpu/check.sh, read without a GPU: it parses, it states a device time under the 9 minutes a lent run may take,
every pytest it starts is stopped by SIGINT (so that its junit file is written), the highest-risk files run first,
and results.json comes from an EXIT trap. Its dry run (CHECK_DRY_RUN=1, a minute or two here) runs the steps."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "bench" / "gpu" / "check.sh"
RISK_FIRST = [
    "test_gpu_linear_attention.py",
    "test_gpu_moe.py",
    "test_gpu_mxfp4.py",
    "test_gpu_fp8_block.py",
    "test_gpu_graphs.py",
    "test_gpu_hybrid_graphs.py",
    "test_gpu_end_to_end.py",
]


def test_check_parses_and_states_a_device_time_under_nine_minutes() -> None:
    result = subprocess.run(["bash", "-n", str(CHECK)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    text = CHECK.read_text()
    stated = re.search(r"Expected device time: about (\d+) minutes", text)
    assert stated and int(stated.group(1)) < 9, "the expected device time belongs at the top, under 9 minutes"
    budget = int(re.search(r"CHECK_BUDGET_S:-(\d+)", text).group(1))
    assert budget + 120 < 9 * 60, "the script's budget and a 2-minute machine start must fit in 9 minutes"


def test_every_pytest_stops_on_sigint_and_the_riskiest_files_come_first() -> None:
    text = CHECK.read_text()
    runs = [line for line in text.splitlines() if "-m pytest" in line and "--collect-only" not in line]
    assert runs and all("timeout -s INT" in line for line in runs), runs
    order = [text.index(name) for name in RISK_FIRST]
    assert order == sorted(order), "the highest-risk test files must run first, in the planned order"
    assert "trap write_results EXIT" in text, "results.json must be written even after a time-out"
    assert "check_steps.py build" not in text.split("run_group risk")[1], "no compile after the tests start"
