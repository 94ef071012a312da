"""The import graph of the whole tree (engine/, worker/, builder/, handler.py): no cycles, and each layer reaches
the next only through its doors. Module-level imports count, type-only ones included; imports inside functions
(the deferred heavy ones) count for the layering rules too."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "engine"
PACKAGES = ("engine", "worker", "builder")
# What the worker and the builder may import from the engine: its public types and the few functions they share.
ENGINE_DOORS = {
    "worker": {"engine", "engine.config", "engine.errors", "engine.outputs", "engine.timing", "engine.sample.params",
               "engine.sample.structured.spec", "engine.sample.structured.rewrite", "engine.core.async_engine",
               "engine.text.detokenizer", "engine.text.o200k_file", "engine.model.folder_check"},
    "builder": {"engine.errors", "engine.text.tokenizer", "engine.model.adapters", "engine.model.models", "engine.model.memory_plan",
                "engine.model.loader", "engine.text.o200k_file", "engine.model.folder_check"},
}


def _imports(path: Path, top_level_only: bool = True) -> set[str]:
    """Modules of our packages that `path` imports (at module level, inside `if TYPE_CHECKING:` too; with
    top_level_only False, inside functions as well)."""
    out: set[str] = set()
    nodes = list(ast.parse(path.read_text()).body) if top_level_only else list(ast.walk(ast.parse(path.read_text())))
    while nodes:
        node = nodes.pop()
        if top_level_only and isinstance(node, ast.If):
            nodes += node.body
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in PACKAGES:
            out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] in PACKAGES}
    return out


def _modules() -> dict[str, Path]:
    paths = {"handler": ROOT / "handler.py"}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            paths[".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = path
    return paths


def test_the_tree_imports_without_cycles() -> None:
    graph = {name: _imports(path) for name, path in _modules().items()}
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


def test_each_layer_reaches_the_next_only_through_its_doors() -> None:
    wrong = []
    for name, path in _modules().items():
        layer = "worker" if name == "handler" else name.split(".")[0]
        for target in _imports(path, top_level_only=False):
            top = target.split(".")[0]
            if layer == "engine" and top != "engine":
                wrong.append(f"{name} imports {target}: the engine knows nothing of the worker or the builder")
            elif layer == "worker" and top == "builder":
                wrong.append(f"{name} imports {target}: the worker serves a bake, it does not make one")
            elif layer in ENGINE_DOORS and top == "engine" and target not in ENGINE_DOORS[layer]:
                wrong.append(f"{name} imports {target}, which is not one of the engine's doors for {layer}/")
    assert not wrong, "\n".join(wrong)


def test_every_engine_package_is_a_folder_that_says_what_lives_there() -> None:
    """engine/'s top level holds only its public types and its packages; no file anywhere passes 300 lines."""
    top = sorted(p.name for p in ENGINE.iterdir() if p.suffix == ".py")
    assert top == ["__init__.py", "config.py", "errors.py", "outputs.py", "timing.py"], top
    long = [f"{p.relative_to(ROOT)}: {n}" for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > 300]
    assert not long, long


def test_starting_the_engine_imports_no_transformers_nor_the_compiler(baked_model_path) -> None:
    # Cold start: transformers (config, tokenizer) and torch's compiler stack (torch._dynamo, sympy, which
    # meta-device module set-up pulls in) cost over a second together; starting on a bake needs none of them.
    import subprocess
    import sys

    code = ("import sys; from engine.config import EngineConfig; from engine.core.engine import LLMEngine; "
            "LLMEngine(EngineConfig(model_path=sys.argv[1], num_kv_pages=16)); "
            "loaded = [m for m in ('transformers', 'torch._dynamo', 'sympy') if m in sys.modules]; "
            "assert not loaded, loaded")
    subprocess.run([sys.executable, "-c", code, str(baked_model_path)], check=True, cwd=ROOT)
