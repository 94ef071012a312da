"""docs/configuration.md is what docs/gen_configuration.py makes of the settings, hub.json and the
Dockerfile, and the README's configuration table names only variables that exist."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from worker.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_page_is_up_to_date(gen: ModuleType) -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page == gen.render(), "docs/configuration.md is stale: run python docs/gen_configuration.py"


def test_configuration_page_documents_every_variable_with_its_default() -> None:
    page = (ROOT / "docs" / "configuration.md").read_text()
    runtime = page.split("## Run-time environment variables", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): m.group(2) for m in re.finditer(r"^\| `([A-Z0-9_]+)` \| ([^|]+) \|", runtime, re.M)}
    for field in Settings.model_fields.values():
        assert field.alias in rows, field.alias
        if field.default is not None and not isinstance(field.default, bool):
            assert str(field.default) in rows[field.alias], field.alias


def test_generator_check_mode_exits_non_zero_when_stale(tmp_path: Path) -> None:
    """`--check` is the CI-style guard; prove it notices a stale page (on a copy, not the real one)."""
    script = (ROOT / "docs" / "gen_configuration.py").read_text()
    stale = tmp_path / "configuration.md"
    stale.write_text("# stale\n")
    patched = script.replace('OUTPUT = ROOT / "docs" / "configuration.md"', f"OUTPUT = Path({str(stale)!r})")
    probe = tmp_path / "gen_probe.py"
    probe.write_text(patched.replace("ROOT = Path(__file__).resolve().parents[1]", f"ROOT = Path({str(ROOT)!r})"))
    stale_run = subprocess.run([sys.executable, str(probe), "--check"], capture_output=True, text=True, timeout=60)
    assert stale_run.returncode == 1 and "out of date" in stale_run.stderr
    fresh_run = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "gen_configuration.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert fresh_run.returncode == 0, fresh_run.stderr


def test_every_build_argument_and_secret_is_documented_in_the_dockerfile(dockerfile: list, gen: ModuleType) -> None:
    args = gen.build_args(dockerfile)
    assert {"MODEL_NAME", "MODEL_REVISION", "BASE_PATH"} <= {name for name, _, _ in args}
    assert all(description for _, _, description in args)
    assert [name for name, _ in gen.secrets(dockerfile)] == ["HF_TOKEN"]


def test_readme_configuration_table_names_real_variables(dockerfile: list, gen: ModuleType) -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    names = re.findall(r"^\| `([A-Z0-9_]+)` \|", section, re.M)
    known = {f.alias for f in Settings.model_fields.values()}
    known |= {name for name, _, _ in gen.build_args(dockerfile)} | {name for name, _ in gen.secrets(dockerfile)}
    assert names, "the README's configuration table is gone"
    assert set(names) <= known, set(names) - known
    assert "docs/configuration.md" in section
