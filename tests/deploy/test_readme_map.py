"""README's "Where things live" map matches the tree: every path it names exists, every package of `engine/` and
`worker/` has a row, and each row stays short (the package's `__init__.py` holds the detail)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SECTION = "## Where things live"
MAX_ROW = 120  # the project's line width: a row that needs more belongs in the package's docstring
FILE_SUFFIXES = (".py", ".md", ".json", ".txt", ".toml", ".sh", ".jinja", ".yml", ".yaml")
# A backticked name that could be a path: no spaces, no call syntax; `--serve` or `EngineConfig` are not paths.
PATH_LIKE = re.compile(r"^[\w.-]+(/[\w.-]+)*/?$")


@dataclass
class Row:
    """One row of the map: the path it is about and the text beside it."""

    path: str
    what: str
    line: str


def map_rows(readme: str) -> list[Row]:
    """The table under SECTION, header and rule left out."""
    section = readme.split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 2 or cells[0] in ("path", "---"):
            continue
        path = re.fullmatch(r"`([^`]+)`", cells[0])
        assert path, f"a map row's first cell is one backticked path: {line}"
        rows.append(Row(path.group(1), cells[1], line))
    return rows


def named_paths(row: Row) -> list[str]:
    """Every path the row names, from the repository root: its own, and those in its text; a bare name there
    (`loader.py`, `structured/`) is inside the row's folder (or beside the row's file)."""
    folder = row.path if row.path.endswith("/") else str(Path(row.path).parent) + "/"
    paths = [row.path]
    for name in re.findall(r"`([^`]+)`", row.what):
        if not PATH_LIKE.match(name) or not (name.endswith("/") or "/" in name or name.endswith(FILE_SUFFIXES)):
            continue
        bare = "/" not in name.rstrip("/")
        paths.append((folder.removeprefix("./") + name) if bare else name)
    return paths


def missing_paths(readme: str) -> list[str]:
    """The paths the map names that the repository does not hold (a folder's must end in `/` and be one)."""
    missing = []
    for row in map_rows(readme):
        for path in named_paths(row):
            target = ROOT / path
            if not (target.is_dir() if path.endswith("/") else target.is_file()):
                missing.append(path)
    return missing


def test_every_path_the_map_names_exists() -> None:
    readme = (ROOT / "README.md").read_text()
    rows = map_rows(readme)
    assert len(rows) >= 20, "the map was not found, or lost its rows"
    assert missing_paths(readme) == []


def test_a_path_that_does_not_exist_is_reported() -> None:
    """The check itself, on a scratch copy: a renamed row path and a renamed bare name in a row's text."""
    readme = (ROOT / "README.md").read_text()
    assert "`engine/core/model_runner.py`" in readme and "(`loader.py`" in readme
    renamed = readme.replace("`engine/core/model_runner.py`", "`engine/core/runner.py`")
    renamed = renamed.replace("(`loader.py`", "(`loaders.py`")
    assert missing_paths(renamed) == ["engine/core/runner.py", "engine/model/loaders.py"]


def test_every_package_has_a_row() -> None:
    named = {row.path for row in map_rows((ROOT / "README.md").read_text())}
    for folder in ("engine", "worker", "engine/core"):
        for package in sorted((ROOT / folder).iterdir()):
            if (package / "__init__.py").is_file():
                assert f"{folder}/{package.name}/" in named, f"README's map has no row for {folder}/{package.name}/"


def test_every_row_is_short() -> None:
    for row in map_rows((ROOT / "README.md").read_text()):
        assert len(row.line) <= MAX_ROW, f"{len(row.line)} characters: {row.line[:80]}..."
