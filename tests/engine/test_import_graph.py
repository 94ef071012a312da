"""The engine's modules import each other without cycles (module-level imports, type-only ones included)."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parents[2] / "engine"


def _imports(path: Path) -> set[str]:
    """engine.* modules that `path` imports at module level (inside `if TYPE_CHECKING:` too, not in functions)."""
    out: set[str] = set()
    nodes = list(ast.parse(path.read_text()).body)
    while nodes:
        node = nodes.pop()
        if isinstance(node, ast.If):
            nodes += node.body
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("engine."):
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("engine.")}
    return out


def test_engine_modules_import_without_cycles() -> None:
    graph = {}
    for path in ENGINE.rglob("*.py"):
        name = ".".join(path.relative_to(ENGINE.parent).with_suffix("").parts).removesuffix(".__init__")
        graph[name] = _imports(path)
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(module: str, path: list[str]) -> None:
        if state.get(module) == 1:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module):] + [module]))
        if state.get(module) == 2 or module not in graph:
            return
        state[module] = 1
        for target in sorted(graph[module]):
            visit(target, [*path, module])
        state[module] = 2

    for module in sorted(graph):
        visit(module, [])


def test_starting_the_engine_imports_no_transformers_nor_the_compiler(baked_model_path) -> None:
    # Cold start: transformers (config, tokenizer) and torch's compiler stack (torch._dynamo, sympy, which
    # meta-device module set-up pulls in) cost over a second together; starting on a bake needs none of them.
    import subprocess
    import sys

    code = ("import sys; from engine.config import EngineConfig; from engine.core.engine import LLMEngine; "
            "LLMEngine(EngineConfig(model_path=sys.argv[1], num_kv_pages=16)); "
            "loaded = [m for m in ('transformers', 'torch._dynamo', 'sympy') if m in sys.modules]; "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code, str(baked_model_path)], check=True, cwd=ENGINE.parent)
