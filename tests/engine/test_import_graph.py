"""The import graph of the whole tree (engine/, worker/, builder/, handler.py): no cycle between modules, package
arrows that point one way (docs of the design: worker -> engine; inside the engine core -> model, attention,
sample, text; model -> attention and layers; cuda below attention), each layer reaching the next only through its
doors, and family files that build on shared blocks rather than on each other.

Every import statement counts, wherever it sits: at module level, inside a function or a class (the deferred
heavy imports are still a dependency), and under `if TYPE_CHECKING:` (a type-only import names a dependency as
much as a call does, so none is exempt). `from a import b` where a.b is a module counts as an import of a.b.
Imports by string (importlib.import_module, the lazy registries of engine/__init__.py and models/__init__.py)
are not seen.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINE = ROOT / "engine"
PACKAGES = ("engine", "worker", "builder")
# What the worker and the builder may import from the engine: its public types and the few functions they share.
ENGINE_DOORS = {
    "worker": {
        "engine",
        "engine.config",
        "engine.errors",
        "engine.inputs",
        "engine.outputs",
        "engine.timing",
        "engine.sample.params",
        "engine.sample.structured.spec",
        "engine.sample.structured.rewrite",
        "engine.core.async_engine",
        "engine.text.detokenizer",
        "engine.text.o200k_file",
        "engine.model.folder_check",
    },
    "builder": {
        "engine.config",
        "engine.errors",
        "engine.text.tokenizer",
        "engine.model.adapters",
        "engine.model.models",
        "engine.model.models.eagle3",
        "engine.model.memory_plan",
        "engine.model.loader",
        "engine.text.o200k_file",
        "engine.model.folder_check",
    },
}
# Package -> the packages it may import (besides itself). A package not named here is a bug of this table.
# "engine" is the engine's public types (config, errors, inputs, outputs, timing), which every engine package may use;
# "worker" is handler.py and worker/'s own modules, "worker.settings" the one of them the protocol layers read.
ARROWS: dict[str, set[str]] = {
    "engine": set(),
    "engine.text": {"engine"},
    "engine.image": {"engine"},
    "engine.sample": {"engine"},
    "engine.cuda": {"engine"},
    "engine.attention": {"engine", "engine.cuda"},
    "engine.model": {"engine", "engine.attention", "engine.cuda"},
    "engine.core": {
        "engine",
        "engine.model",
        "engine.attention",
        "engine.sample",
        "engine.text",
        "engine.image",
        "engine.cuda",
    },
    "worker.settings": set(),
    "worker.openai": {"worker.settings", "engine"},
    "worker.anthropic": {"worker.openai", "worker.settings", "engine"},
    "worker": {"worker.openai", "worker.anthropic", "worker.settings", "engine"},
    "builder": {"engine"},
}
ENGINE_PACKAGES = ("core", "model", "attention", "sample", "text", "image", "cuda")
FAMILIES = "engine.model.models."
# Family files and what they build on: models/base.py, models/encoder_base.py, models/moe_base.py, models/mtp_base.py
# and models/mamba2_base.py (the Mamba2 / attention hybrids' bookkeeping), the blocks of layers/, and no other family's
# file but these (family -> family files it extends, with why).
SHARED_MODEL_FILES = {
    "engine.model.models",
    "engine.model.models.base",
    "engine.model.models.encoder_base",
    "engine.model.models.mamba2_base",
    "engine.model.models.moe_base",
    "engine.model.models.mtp_base",
}
FAMILY_BASES = {
    # The Llama decoder is the dense decoder the Llama-attention MoE decoders extend.
    "engine.model.models.moe_base": {"engine.model.models.llama"},
    "engine.model.models.qwen3_moe": {"engine.model.models.llama"},
    # OLMoE's attention is OLMo 2's (one norm over each whole q and k projection).
    "engine.model.models.olmoe": {"engine.model.models.llama", "engine.model.models.olmo2"},
    # Phi-3 / Phi-4 is the Llama decoder with fused checkpoint tensors and partial rotary.
    "engine.model.models.phi3": {"engine.model.models.llama"},
    # Phi-3.5-MoE is Mixtral's decoder (its hub names) with LayerNorm, sparsemixer routing and Phi-3's LongRoPE.
    "engine.model.models.phimoe": {
        "engine.model.models.llama",
        "engine.model.models.moe_base",
        "engine.model.models.mixtral",
        "engine.model.models.phi3",
    },
    # ERNIE 4.5 MoE is ERNIE 4.5's (the Llama) decoder with DeepSeek-style routing.
    "engine.model.models.ernie4_5_moe": {"engine.model.models.llama", "engine.model.models.moe_base"},
    # Granite is the Llama decoder with four scalars.
    "engine.model.models.granite": {"engine.model.models.llama", "engine.model.models.moe_base"},
    # Granite 4.0-H is Granite 3 MoE's decoder (its scalars, names and shared MLP) with Mamba2 beside attention.
    "engine.model.models.granitemoehybrid": {
        "engine.model.models.granite",
        "engine.model.models.llama",
        "engine.model.models.moe_base",
    },
    # OLMo 2 / 3 and EXAONE 4 are Llama decoders with their norms after attention and MLP.
    "engine.model.models.olmo2": {"engine.model.models.llama"},
    "engine.model.models.glm4_moe": {"engine.model.models.llama"},
    # DeepSeek's dense MLP and shared experts are the Llama gated MLP (its attention is layers/mla.py's).
    "engine.model.models.deepseek_v2": {"engine.model.models.llama"},
    # An EAGLE-3 head is a one-layer Llama decoder with a wider qkv.
    "engine.model.models.eagle3": {"engine.model.models.llama"},
    # Qwen2.5-VL's text model is Qwen2's, the Llama decoder.
    "engine.model.models.qwen2_5_vl": {"engine.model.models.llama"},
    # Qwen3-VL's text model is Qwen3's (its MoE Qwen3-MoE's) decoder.
    "engine.model.models.qwen3_vl": {
        "engine.model.models.llama",
        "engine.model.models.moe_base",
        "engine.model.models.qwen3_moe",
    },
    # Mistral 3's text model is the Llama decoder (Mistral / Ministral 3) with the Pixtral tower beside it.
    "engine.model.models.mistral3": {"engine.model.models.llama"},
    # The hybrid decoders' full-attention layer and MLP are the Llama ones, their routing Qwen's MoE rule.
    "engine.model.models.qwen3_5": {"engine.model.models.llama", "engine.model.models.qwen3_moe"},
    # Nemotron-H's attention block is the Llama attention without rotary (its args the MoE decoder's).
    "engine.model.models.nemotron_h": {"engine.model.models.llama"},
    # Falcon-H1 is the Llama decoder (attention, rotary, head) with a Mamba2 mixer beside each attention.
    "engine.model.models.falcon_h1": {"engine.model.models.llama"},
    # The MTP head of a Qwen3.5 / Qwen3-Next checkpoint is one more full-attention layer of that family.
    "engine.model.models.qwen3_5_mtp": {"engine.model.models.qwen3_5"},
    # The next-n head of a DeepSeek-V3 / GLM-4.5 checkpoint is one more decoder layer of that family (DeepSeek's MLA
    # layer, GLM-4.5's Llama-attention one, their experts or the Llama MLP).
    "engine.model.models.next_n_mtp": {
        "engine.model.models.deepseek_v2",
        "engine.model.models.glm4_moe",
        "engine.model.models.llama",
    },
    # One Gemma decoder (gemma_args / gemma_layers / gemma_base) that each generation configures.
    "engine.model.models.gemma_layers": {"engine.model.models.gemma_args", "engine.model.models.gemma4_moe"},
    "engine.model.models.gemma_base": {"engine.model.models.gemma_args", "engine.model.models.gemma_layers"},
    "engine.model.models.gemma2": {"engine.model.models.gemma_args", "engine.model.models.gemma_base"},
    "engine.model.models.gemma3": {
        "engine.model.models.gemma_args",
        "engine.model.models.gemma_base",
        "engine.model.models.gemma2",
    },
    "engine.model.models.gemma4": {
        "engine.model.models.gemma_args",
        "engine.model.models.gemma_base",
        "engine.model.models.gemma2",
        "engine.model.models.gemma4_moe",
    },
    # A Gemma 4 image-text checkpoint is the Gemma 4 text model with its vision tower beside it.
    "engine.model.models.gemma4_multimodal": {
        "engine.model.models.gemma_args",
        "engine.model.models.gemma_base",
        "engine.model.models.gemma4",
    },
}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module (the package itself for a name that is not a module of it)
    line: int

    def __str__(self) -> str:
        path = _modules()[self.source].relative_to(ROOT)
        return f"{path}:{self.line} ({self.source}) imports {self.target}"


@cache
def _modules() -> dict[str, Path]:
    paths = {"handler": ROOT / "handler.py"}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            paths[".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")] = path
    return paths


def _resolve(name: str) -> str:
    """The module of ours that `name` is, or the nearest package above it that is one."""
    modules = _modules()
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


@cache
def _imports(module: str) -> tuple[Import, ...]:
    """Every import of our packages in `module`, anywhere in its syntax tree."""
    out = []
    for node in ast.walk(ast.parse(_modules()[module].read_text())):
        if (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and node.module
            and node.module.split(".")[0] in PACKAGES
        ):
            for alias in node.names:
                out.append(Import(module, _resolve(f"{node.module}.{alias.name}"), node.lineno))
        elif isinstance(node, ast.Import):
            out += [
                Import(module, _resolve(a.name), node.lineno) for a in node.names if a.name.split(".")[0] in PACKAGES
            ]
    return tuple(sorted(set(out), key=lambda i: (i.line, i.target)))


def _package(module: str) -> str:
    """The package of ARROWS that `module` belongs to."""
    parts = module.split(".")
    if module == "handler":
        return "worker"
    if parts[0] == "engine":
        return f"engine.{parts[1]}" if len(parts) > 1 and parts[1] in ENGINE_PACKAGES else "engine"
    if parts[0] == "worker" and len(parts) > 1 and parts[1] in ("openai", "anthropic", "settings"):
        return f"worker.{parts[1]}"
    return parts[0]


def test_the_import_graph_sees_deferred_and_type_only_imports() -> None:
    # The scanner itself: a function-level import and a TYPE_CHECKING one are both edges.
    targets = {i.target for i in _imports("worker.runtime")}
    assert "engine.core.async_engine" in targets  # inside start()
    assert "engine.attention.base" in {i.target for i in _imports("engine.model.models")}  # under TYPE_CHECKING


def test_the_tree_imports_without_cycles() -> None:
    """No cycle between modules, counting deferred imports: a cycle broken only by a function-level import is
    still two modules that cannot be understood (or moved) one without the other."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles = []

    def visit(module: str, path: list[Import]) -> None:
        state[module] = 1
        for edge in _imports(module):
            if edge.target == module or edge.target not in _modules():
                continue
            if state.get(edge.target) == 1:
                start = next(i for i, e in enumerate([*path, edge]) if e.source == edge.target)
                cycles.append("import cycle:\n  " + "\n  ".join(str(e) for e in [*path, edge][start:]))
            elif state.get(edge.target) is None:
                visit(edge.target, [*path, edge])
        state[module] = 2

    for module in sorted(_modules()):
        if module not in state:
            visit(module, [])
    assert not cycles, "\n".join(cycles)


def test_package_arrows_point_one_way() -> None:
    unknown = sorted({_package(m) for m in _modules()} - set(ARROWS))
    assert not unknown, f"packages with no row in ARROWS: {unknown}"
    wrong = []
    for module in sorted(_modules()):
        for edge in _imports(module):
            source, target = _package(module), _package(edge.target)
            if not source.startswith("engine") and target.startswith("engine"):
                target = "engine"  # which engine modules the worker and the builder reach: their doors, below
            if source != target and target not in ARROWS[source]:
                wrong.append(
                    f"{edge}: {source} may not import {target} (it may import: "
                    f"{', '.join(sorted(ARROWS[source])) or 'nothing of ours'})"
                )
    assert not wrong, "reversed or unplanned package arrows:\n" + "\n".join(wrong)


def test_family_files_build_on_shared_blocks_not_on_each_other() -> None:
    """A block two families share lives in layers/ or models/base.py (moe_base.py for the MoE decoders), and
    layers/ and quant/ know nothing of the families or the loader."""
    wrong = []
    for module in sorted(_modules()):
        for edge in _imports(module):
            t = edge.target
            if (
                module.startswith(FAMILIES)
                and t.startswith(FAMILIES)
                and t != module
                and t not in SHARED_MODEL_FILES
                and t not in FAMILY_BASES.get(module, ())
            ):
                wrong.append(f"{edge}: a family file builds on layers/ and models/base.py, not on another family")
            elif module.startswith(("engine.model.layers", "engine.model.quant")) and (
                t.startswith(FAMILIES) or t == "engine.model.models" or t == "engine.model.loader"
            ):
                wrong.append(f"{edge}: layers/ and quant/ sit below the families and the loader")
    assert not wrong, "\n".join(wrong)


def test_each_layer_reaches_the_next_only_through_its_doors() -> None:
    wrong = []
    for name in _modules():
        layer = "worker" if name == "handler" else name.split(".")[0]
        for edge in _imports(name):
            top = edge.target.split(".")[0]
            if layer == "engine" and top != "engine":
                wrong.append(f"{edge}: the engine knows nothing of the worker or the builder")
            elif layer == "worker" and top == "builder":
                wrong.append(f"{edge}: the worker serves a bake, it does not make one")
            elif layer == "builder" and top == "worker":
                wrong.append(f"{edge}: the builder makes a bake, it does not serve one")
            elif layer in ENGINE_DOORS and top == "engine" and edge.target not in ENGINE_DOORS[layer]:
                wrong.append(f"{edge}, which is not one of the engine's doors for {layer}/")
    assert not wrong, "\n".join(wrong)


# Lines are counted as `ruff format` writes them (make test checks the formatting), so a file cannot pass the cap by
# joining lines. A file of one role stays under FILE_LINES; the hubs, where a request's path meets every collaborator,
# may run longer, and their cap still stops them from growing without a split.
FILE_LINES = 400
HUB_LINES = {
    "engine/core/engine.py": 500,
    "engine/core/async_engine.py": 500,
    "engine/core/model_runner.py": 500,
    "worker/server.py": 500,
}


def test_every_engine_package_is_a_folder_that_says_what_lives_there() -> None:
    """engine/'s top level holds only its public types and its packages; no file passes FILE_LINES (the hubs
    HUB_LINES)."""
    top = sorted(p.name for p in ENGINE.iterdir() if p.suffix == ".py")
    assert top == ["__init__.py", "config.py", "errors.py", "inputs.py", "outputs.py", "timing.py"], top
    long = [
        f"{path}: {n}"
        for p in _modules().values()
        if (n := len(p.read_text().splitlines())) > HUB_LINES.get(path := p.relative_to(ROOT).as_posix(), FILE_LINES)
    ]
    assert not long, long


def test_starting_the_engine_imports_no_transformers_nor_the_compiler(baked_model_path) -> None:
    # Cold start: transformers (config, tokenizer) and torch's compiler stack (torch._dynamo, sympy, which
    # meta-device module set-up pulls in) cost over a second together; starting on a bake needs none of them.
    import subprocess
    import sys

    code = (
        "import sys; from engine.config import EngineConfig; from engine.core.engine import LLMEngine; "
        "LLMEngine(EngineConfig(model_path=sys.argv[1], num_kv_pages=16)); "
        "loaded = [m for m in ('transformers', 'torch._dynamo', 'sympy') if m in sys.modules]; "
        "assert not loaded, loaded"
    )
    subprocess.run([sys.executable, "-c", code, str(baked_model_path)], check=True, cwd=ROOT)
