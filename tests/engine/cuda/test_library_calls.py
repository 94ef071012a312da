"""Every call the engine makes into a GPU library (FlashInfer, fla, causal-conv1d, and torch's CUDA-only FP8 GEMMs)
bound to the installed release's real signature, on the CPU: those packages import without a GPU, so a renamed parameter
or an argument in the wrong place fails here, not on the first GPU that runs it. The calls are found in the engine's
source (no call runs).

The rule each call must keep: every argument by keyword, except where the library's parameter is positional-only or
the call fills the function's *args (FlashInfer's run(q, paged_kv_cache, *extra) for a JIT variant's parameters);
no ** or * expansion, so the names are visible here; every keyword names a parameter (not one swallowed by
**kwargs). A positional argument is how fla-core 0.6.0's fused recurrent rule got beta in its gk slot.

These run where the libraries are installed: `make test`'s image-torch venv (requirements-cuda.txt); elsewhere they
skip, saying which library is missing.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
from dataclasses import dataclass
from pathlib import Path

import pytest

import engine

ROOT = Path(__file__).resolve().parents[3]
ENGINE = ROOT / "engine"
LIBRARIES = ("flashinfer", "fla", "causal_conv1d")
# torch's calls that run only on a GPU, as the engine writes them (torch and torch.nn.functional as F everywhere).
TORCH_CUDA_CALLS = {"torch._scaled_mm": "torch._scaled_mm", "F.scaled_mm": "torch.nn.functional.scaled_mm"}
PREFILL, DECODE = "flashinfer.BatchPrefillWithPagedKVCacheWrapper", "flashinfer.BatchDecodeWithPagedKVCacheWrapper"
MLA = "flashinfer.mla.BatchMLAPagedAttentionWrapper"
# Calls on FlashInfer wrapper objects, whose class the source does not say: the receiver as written, per file.
WRAPPER_RECEIVERS = {
    "engine/attention/flashinfer.py": {
        "self._prefill": (PREFILL,),
        "self._sink_wrapper": (PREFILL,),
        "decode": (DECODE,),
        "self._active": (PREFILL, DECODE),
    },
    "engine/attention/flashinfer_graph.py": {"self.wrapper": (DECODE,)},
    "engine/attention/flashinfer_mla.py": {"self._wrapper": (MLA,)},
}
WRAPPER_METHODS = ("plan", "run", "begin_forward", "forward", "reset_workspace_buffer", "end_forward")
# Calls that must be found, so that a change in how the engine imports these cannot make the test pass on nothing.
EXPECTED = {
    "fla.ops.gated_delta_rule.chunk_gated_delta_rule",
    "fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule",
    "fla.ops.simple_gla.chunk_simple_gla",
    "fla.ops.simple_gla.fused_recurrent_simple_gla",
    "causal_conv1d.causal_conv1d_update",
    "causal_conv1d.causal_conv1d_fn",
    "flashinfer.norm.rmsnorm",
    "flashinfer.norm.fused_add_rmsnorm",
    "flashinfer.rope.apply_rope_with_cos_sin_cache_inplace",
    "flashinfer.activation.silu_and_mul",
    PREFILL,
    DECODE,
    f"{PREFILL}.plan",
    f"{PREFILL}.run",
    f"{DECODE}.plan",
    f"{DECODE}.run",
    MLA,
    f"{MLA}.plan",
    f"{MLA}.run",
    "flashinfer.jit.attention.modules.gen_batch_mla_module",
    "flashinfer.jit.attention.modules.get_batch_mla_uri",
    *TORCH_CUDA_CALLS.values(),
}


@dataclass(frozen=True)
class LibraryCall:
    """One call site: where, what it calls (a dotted path into the library), and the call's node."""

    path: str
    line: int
    target: str
    node: ast.Call

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}:{self.target}"


def dotted(node: ast.expr) -> str | None:
    """`a.b.c` for a chain of names and attributes, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def imported_names(body: list[ast.stmt]) -> dict[str, str]:
    """Local name -> dotted library path for the library imports in `body`, its if / try / with blocks included
    (not in nested functions or classes, which have their own scope here)."""
    names = {}
    for statement in body:
        if isinstance(statement, ast.Import):
            for alias in statement.names:
                if alias.name.split(".")[0] in LIBRARIES:
                    local = alias.asname or alias.name.split(".")[0]
                    names[local] = alias.name if alias.asname else local
        elif isinstance(statement, ast.ImportFrom) and (statement.module or "").split(".")[0] in LIBRARIES:
            for alias in statement.names:
                names[alias.asname or alias.name] = f"{statement.module}.{alias.name}"
        elif isinstance(statement, (ast.If, ast.Try, ast.With, ast.For)):
            blocks = [statement.body, getattr(statement, "orelse", []), getattr(statement, "finalbody", [])]
            blocks += [handler.body for handler in getattr(statement, "handlers", [])]
            for block in blocks:
                names.update(imported_names(block))
    return names


def library_calls() -> list[LibraryCall]:
    """Every call in engine/ into a library of LIBRARIES, through an imported name or a known wrapper receiver."""
    return [call for file in sorted(ENGINE.rglob("*.py")) for call in calls_in_file(file)]


def calls_in_file(file: Path) -> list[LibraryCall]:
    """The library calls of one engine file (library_calls' rule)."""
    calls = []
    path = file.relative_to(ROOT).as_posix()
    tree = ast.parse(file.read_text())
    receivers = WRAPPER_RECEIVERS.get(path, {})

    def visit(node: ast.AST, scope: dict[str, str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            scope = {**scope, **imported_names(node.body)}
        if isinstance(node, ast.Call):
            name = dotted(node.func)
            if name is not None:
                root, _, rest = name.partition(".")
                receiver, _, method = name.rpartition(".")
                if name in TORCH_CUDA_CALLS:
                    calls.append(LibraryCall(path, node.lineno, TORCH_CUDA_CALLS[name], node))
                elif root in scope:
                    calls.append(LibraryCall(path, node.lineno, ".".join(filter(None, [scope[root], rest])), node))
                elif receiver in receivers:
                    calls.extend(LibraryCall(path, node.lineno, f"{cls}.{method}", node) for cls in receivers[receiver])
                elif method in WRAPPER_METHODS and path in WRAPPER_RECEIVERS and receiver != "self":
                    raise AssertionError(
                        f"{path}:{node.lineno}: {name}() may call a FlashInfer wrapper: "
                        "name its receiver in WRAPPER_RECEIVERS"
                    )
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(tree, imported_names(tree.body))
    return calls


CALLS = library_calls()


def resolve(target: str) -> object:
    """The object at a dotted path (module, then attributes); skips when the library does not import here."""
    parts = target.split(".")
    library = parts[0]
    try:
        importlib.import_module(library)
    except Exception as exc:  # a CUDA library on a machine without its build raises more than ImportError
        pytest.skip(
            f"{library} does not import here ({type(exc).__name__}: {exc}); requirements-cuda.txt's "
            "packages are installed in `make test`'s image-torch venv, and causal_conv1d (a source release "
            "built with nvcc) nowhere without a GPU"
        )
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            obj = getattr(obj, attribute)
        return obj
    raise AssertionError(f"nothing importable at {target}")


def test_every_expected_call_is_found() -> None:
    found = {call.target for call in CALLS}
    assert EXPECTED <= found, f"not found in engine/: {sorted(EXPECTED - found)}"


def signature_of(target: str, function: object) -> inspect.Signature:
    """inspect's signature, or for one of torch's builtin operators the one its schema declares (`self` positional)."""
    try:
        return inspect.signature(function)
    except ValueError:
        import torch

        (schema, *_) = torch._C._jit_get_schemas_for_operator(f"aten::{target.rsplit('.', 1)[-1]}")
        kinds = inspect.Parameter
        return inspect.Signature(
            [
                inspect.Parameter(
                    arg.name,
                    kinds.POSITIONAL_ONLY
                    if arg.name == "self"
                    else kinds.KEYWORD_ONLY
                    if arg.kwarg_only
                    else kinds.POSITIONAL_OR_KEYWORD,
                    default=arg.default_value if arg.has_default_value() else inspect.Parameter.empty,
                )
                for arg in schema.arguments
            ]
        )


@pytest.mark.parametrize("call", CALLS, ids=lambda call: call.id)
def test_call_binds_by_keyword_to_the_installed_signature(call: LibraryCall) -> None:
    where = f"{call.path}:{call.line} calls {call.target}"
    node = call.node
    assert not any(isinstance(arg, ast.Starred) for arg in node.args), f"{where} with *args expanded"
    assert all(kw.arg is not None for kw in node.keywords), f"{where} with **kwargs expanded"
    signature = signature_of(call.target, resolve(call.target))
    parameters = list(signature.parameters.values())
    if parameters and parameters[0].name == "self" and parameters[0].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
        # a method looked up on its class: the receiver binds self
        signature = signature.replace(parameters=parameters[1:])
    positional = [object()] * len(node.args)
    keywords = {kw.arg: object() for kw in node.keywords}
    try:
        bound = signature.bind(*positional, **keywords)
    except TypeError as exc:
        raise AssertionError(f"{where}: {exc} (signature {signature})") from None
    kinds = {p.name: p.kind for p in signature.parameters.values()}
    fills_var_positional = any(
        kinds[name] is inspect.Parameter.VAR_POSITIONAL and value for name, value in bound.arguments.items()
    )
    for name, value in bound.arguments.items():
        kind = kinds[name]
        if kind is inspect.Parameter.VAR_KEYWORD:
            raise AssertionError(f"{where}: {sorted(value)} name no parameter of {signature}")
        if kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and name not in keywords and not fills_var_positional:
            raise AssertionError(f"{where}: {name!r} is passed by position; pass it by keyword")


def test_every_engine_module_imports() -> None:
    """Under the image's torch with the CUDA packages installed, every module imports (the CUDA paths' imports are
    lazy, but their module-level code runs here)."""
    names = [m.name for m in pkgutil.walk_packages(engine.__path__, prefix="engine.")]
    assert len(names) > 100
    for name in names:
        importlib.import_module(name)
