"""One owner per state: the scheduler side (scheduler, KV manager) never reads or writes a sequence's output
state, and the output side (output processor, output state) never touches its pages or computed length."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[3] / "engine" / "core"
KV_SIDE = {
    "kv_pages",
    "pages",
    "num_computed_tokens",
    "page_hashes",
    "reset",
    "state_slot",
    "state_capture",
    "state_snapshot",
}
OUTPUT_SIDE = {"output_state", "detokenizer", "grammar", "stop_reader", "generator", "penalties"}


def _attributes(name: str) -> set[str]:
    tree = ast.parse((CORE / name).read_text())
    return {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)}


def test_the_scheduler_side_never_touches_output_state() -> None:
    for name in ("scheduling/scheduler.py", "kv/manager.py", "kv/cache.py"):
        assert not _attributes(name) & OUTPUT_SIDE, name


def test_the_output_side_never_touches_pages() -> None:
    for name in ("output/processor.py", "output/state.py"):
        assert not _attributes(name) & KV_SIDE, name


def test_the_attribute_sets_name_real_fields() -> None:
    # Guards the two tests above against a rename that would leave them checking nothing.
    from engine.core.output.state import OutputState
    from engine.core.scheduling.sequence import Sequence

    seq = Sequence(seq_id=0, token_ids=[1, 2], num_prompt_tokens=2)
    assert all(hasattr(seq, a) for a in KV_SIDE)
    assert all(hasattr(seq.output_state, a) for a in OUTPUT_SIDE - {"output_state"})
    assert isinstance(seq.output_state, OutputState)
