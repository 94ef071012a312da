"""Every class in engine/, worker/, builder/ and handler.py whose constructor takes more than four parameters takes
them by keyword only, so that no call site passes a row of adjacent ints whose order only the definition knows.

The constructor is read from the source, not imported. An explicit `__init__` counts its parameters after self, and
is keyword-only by a bare `*` right after self. A `@dataclass` counts its init fields (class-level annotations that
are not ClassVar nor `field(init=False)`): its own and those of its dataclass bases, found by name (in the same file,
else the one class of that name in the tree), and so on up; a field is keyword-only by `kw_only=True` on its
class's decorator, by `field(kw_only=True)` or by coming after `_: KW_ONLY`. A NamedTuple counts its fields, which
are positional by nature, so one of more than four fails. Pydantic models take keywords already (BaseModel's
`__init__(**data)`) and are not counted. torch.nn.Module subclasses are counted like any class.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "worker", "builder")
MAX_POSITIONAL = 4


def _modules() -> list[Path]:
    files = [ROOT / "handler.py"]
    for package in PACKAGES:
        files += sorted((ROOT / package).rglob("*.py"))
    return files


def _name(node: ast.expr) -> str:
    """The last dotted part of a name, an attribute or a call's callee: `dataclasses.dataclass(...)` -> dataclass."""
    if isinstance(node, ast.Call):
        node = node.func
    if isinstance(node, ast.Subscript):
        node = node.value
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _dataclass_kw_only(cls: ast.ClassDef) -> bool | None:
    """None when cls is not a dataclass; else whether the decorator says kw_only=True."""
    for deco in cls.decorator_list:
        if _name(deco) == "dataclass":
            if isinstance(deco, ast.Call):
                for kw in deco.keywords:
                    if kw.arg == "kw_only" and isinstance(kw.value, ast.Constant) and kw.value.value is True:
                        return True
            return False
    return None


def _call_keyword(value: ast.expr | None, name: str) -> object:
    """The constant value of keyword `name` of a `field(...)` default, or None."""
    if isinstance(value, ast.Call) and _name(value) == "field":
        for kw in value.keywords:
            if kw.arg == name and isinstance(kw.value, ast.Constant):
                return kw.value.value
    return None


def _fields(cls: ast.ClassDef, class_kw_only: bool) -> list[tuple[str, bool]]:
    """(name, keyword-only) for each init field written in cls's own body."""
    fields, after_marker = [], False
    for stmt in cls.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            continue
        if _name(stmt.annotation) == "KW_ONLY":
            after_marker = True
            continue
        if _name(stmt.annotation) == "ClassVar":
            continue
        if _call_keyword(stmt.value, "init") is False:
            continue
        kw_only = class_kw_only or after_marker or _call_keyword(stmt.value, "kw_only") is True
        fields.append((stmt.target.id, kw_only))
    return fields


def _constructor(cls: ast.ClassDef, classes: dict[str, ast.ClassDef]) -> tuple[list[str], list[str]] | None:
    """(positional, keyword-only) parameter names of cls's constructor, or None when it is not counted."""
    bases = {_name(b) for b in cls.bases}
    if "BaseModel" in bases:
        return None
    init = next((s for s in cls.body if isinstance(s, ast.FunctionDef) and s.name == "__init__"), None)
    if init is not None:
        args = init.args
        positional = [a.arg for a in (args.posonlyargs + args.args)[1:]]
        return positional, [a.arg for a in args.kwonlyargs]
    if "NamedTuple" in bases:
        return [name for name, _ in _fields(cls, False)], []
    if _dataclass_kw_only(cls) is None:
        return None
    fields = _dataclass_fields(cls, classes)
    return [n for n, k in fields if not k], [n for n, k in fields if k]


def _dataclass_fields(cls: ast.ClassDef, classes: dict[str, ast.ClassDef]) -> list[tuple[str, bool]]:
    """(name, keyword-only) of a dataclass's init fields: those of its dataclass bases first, then its own."""
    fields: list[tuple[str, bool]] = []
    for base in cls.bases:
        parent = classes.get(_name(base))
        if parent is not None and parent is not cls and _dataclass_kw_only(parent) is not None:
            fields += _dataclass_fields(parent, classes)
    return fields + _fields(cls, bool(_dataclass_kw_only(cls)))


def _wide_positional() -> list[str]:
    trees = {path: ast.parse(path.read_text(), filename=str(path)) for path in _modules()}
    everywhere: dict[str, list[ast.ClassDef]] = {}
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                everywhere.setdefault(node.name, []).append(node)
    found = []
    for path, tree in trees.items():
        own = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        # a base defined in this file, else one of that name defined once in the tree (imported from there)
        classes = {name: nodes[0] for name, nodes in everywhere.items() if len(nodes) == 1} | own
        for cls in own.values():
            signature = _constructor(cls, classes)
            if signature is None:
                continue
            positional, keyword = signature
            if len(positional) + len(keyword) > MAX_POSITIONAL and positional:
                where = f"{path.relative_to(ROOT).as_posix()}:{cls.lineno}"
                found.append(f"{where} {cls.name}({', '.join(positional)}, ...)")
    return found


def test_wide_constructors_are_keyword_only():
    found = _wide_positional()
    assert not found, "constructors of more than four parameters that take some by position:\n" + "\n".join(found)
