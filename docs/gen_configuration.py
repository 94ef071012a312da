"""Writes docs/configuration.md from the three places configuration lives, so the page cannot drift:
worker/settings.py (run-time variables: names, defaults, accepted values), .runpod/hub.json (their
descriptions, as RunPod Hub users see them) and the Dockerfile (build arguments, secrets, image env).

    python docs/gen_configuration.py           rewrite docs/configuration.md
    python docs/gen_configuration.py --check   exit 1 when the page is out of date (the tests run this)
"""

from __future__ import annotations

import json
import re
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "configuration.md"

# Variables the worker reads that a RunPod endpoint has no use for, so hub.json leaves them out.
LOCAL_ONLY = {
    "RUNPOD_API_KEY": "Local endpoint only (`python handler.py --serve`): when set, every route except "
    "`/health` requires `Authorization: Bearer <key>`, so clients configured for the hosted endpoint work "
    "unchanged. On RunPod the platform checks the key before a job reaches the worker.",
    "RUNPOD_WEBHOOK_GET_JOB": "Set by RunPod on its workers, never by hand: `python handler.py` then runs the "
    "serverless job loop; unset, it runs one local test job (`--test_input`).",
    "MAX_REQUEST_MB": "Local endpoint only: a request body over this many MiB is refused with a 413 before it is "
    "read whole (at once when Content-Length says so). On RunPod the platform's own payload limits apply.",
    "METRICS_PUBLIC": "Local endpoint only: `1` serves `/metrics` (Prometheus' text format) without the API key, as "
    "`/health` is, for scrapers that carry none; by default it needs the key like every other route.",
}
# What the image's own settings are for (an ENV line the Dockerfile adds needs a line here).
IMAGE_ENV_MEANING = {
    "FLASHINFER_WORKSPACE_BASE": "where FlashInfer keeps its compiled kernels (precompiled at build time)",
    "BASE_PATH": "where the worker finds the baked model",
    "HF_HUB_OFFLINE": "the model is in the image or in a hub cache: no download is ever attempted",
    "TRANSFORMERS_OFFLINE": "the same for transformers",
    "RAYON_NUM_THREADS": "caps the tokenizer's thread pool, which would otherwise start one thread per host core",
}
# The image's own ENV lines that are plumbing rather than configuration.
PLUMBING_ENV = {
    "DEBIAN_FRONTEND",
    "PYTHONUNBUFFERED",
    "PYTHONDONTWRITEBYTECODE",
    "PIP_DISABLE_PIP_VERSION_CHECK",
    "PIP_ROOT_USER_ACTION",
    "VIRTUAL_ENV",
    "PATH",
}


@dataclass
class Instruction:
    """One Dockerfile instruction with its continuation lines joined and the comment block just above it."""

    keyword: str
    value: str
    comments: list[str]
    line: int


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions in order; comment lines inside a continuation are dropped, as Docker drops them."""
    out: list[Instruction] = []
    comments: list[str] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        start = i
        i += 1
        if not stripped:
            comments = []
            continue
        if stripped.startswith("#"):
            comments.append(stripped[1:].strip())
            continue
        parts = [stripped]
        while parts[-1].endswith("\\") and i < len(lines):
            parts[-1] = parts[-1][:-1].rstrip()
            nxt = lines[i].strip()
            i += 1
            if not nxt.startswith("#"):
                parts.append(nxt)
        keyword, _, value = " ".join(p for p in parts if p).partition(" ")
        out.append(Instruction(keyword.upper(), value.strip(), comments, start + 1))
        comments = []
    return out


def described(instruction: Instruction, name: str) -> str:
    """The text after `NAME:` in the comment block above the instruction (to the block's end)."""
    for index in range(len(instruction.comments) - 1, -1, -1):
        if instruction.comments[index].startswith(f"{name}:"):
            text = [instruction.comments[index][len(name) + 1 :].strip(), *instruction.comments[index + 1 :]]
            joined = " ".join(t for t in text if t)
            return joined[:1].upper() + joined[1:]
    raise SystemExit(f"Dockerfile line {instruction.line}: document {name} in a `# {name}: ...` comment above it")


def build_args(instructions: list[Instruction]) -> list[tuple[str, str, str]]:
    """(name, default, description) of every ARG."""
    rows = []
    for ins in instructions:
        if ins.keyword == "ARG":
            name, _, default = ins.value.partition("=")
            rows.append((name, default.strip('"'), described(ins, name)))
    return rows


def secrets(instructions: list[Instruction]) -> list[tuple[str, str]]:
    """(id, description) of every BuildKit secret a RUN mounts."""
    rows = []
    for ins in instructions:
        for secret_id in re.findall(r"--mount=type=secret,id=([A-Za-z0-9_]+)", ins.value):
            rows.append((secret_id, described(ins, secret_id)))
    return rows


def image_env(instructions: list[Instruction]) -> list[tuple[str, str]]:
    """(name, value) of the image's ENV settings, plumbing left out."""
    rows = []
    for ins in instructions:
        if ins.keyword == "ENV":
            for name, value in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=(\"[^\"]*\"|\S+)", ins.value):
                if name not in PLUMBING_ENV:
                    value = value.strip('"')
                    arg = re.fullmatch(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?", value)
                    rows.append((name, f"the `{arg.group(1)}` build argument" if arg else f"`{value}`"))
    return rows


def image_env_meaning(name: str) -> str:
    if name not in IMAGE_ENV_MEANING:
        raise SystemExit(f"the Dockerfile sets {name}: say what it is for in IMAGE_ENV_MEANING, in {__file__}")
    return IMAGE_ENV_MEANING[name]


def accepts(field: Any) -> str:
    """What a variable accepts, in words, from the pydantic field (type, Literal values, bounds)."""
    annotation = field.annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    base = args[0] if typing.get_origin(annotation) is not typing.Literal and args else annotation
    if typing.get_origin(base) is typing.Literal:
        return ", ".join(f"`{v}`" for v in typing.get_args(base))
    words = {bool: "`true`/`false` (or `1`/`0`)", int: "integer", float: "number", str: "text"}[base]
    limits = []
    for bound in field.metadata:
        for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if getattr(bound, attr, None) is not None:
                limits.append(f"{sign} {getattr(bound, attr)}")
        if getattr(bound, "min_length", None):
            words = "non-empty " + words
    return " ".join([words, " and ".join(limits)]).strip()


def shown_default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    return f"`{value}`"


def hub_descriptions(hub: dict) -> dict[str, str]:
    return {entry["key"]: entry["input"]["description"] for entry in hub["config"]["env"] if "input" in entry}


def render() -> str:
    """The whole page."""
    sys.path.insert(0, str(ROOT))
    from worker.settings import Settings

    hub = hub_descriptions(json.loads((ROOT / ".runpod" / "hub.json").read_text()))
    docker = parse_dockerfile((ROOT / "Dockerfile").read_text())
    lines = [
        "# Configuration",
        "",
        "<!-- Generated by `python docs/gen_configuration.py` from worker/settings.py, .runpod/hub.json and the",
        "     Dockerfile; edit those and rerun it. The test suite fails while this page is out of date. -->",
        "",
        "## Run-time environment variables",
        "",
        "Set them on the RunPod endpoint (or template), or in the shell for local runs. An empty value counts",
        "as unset. A bad value stops the worker at start-up with one line naming the variable and what it",
        "accepts. `DTYPE` also takes `half`, `float`, `bf16`, `fp16` and `fp32`.",
        "",
        "| variable | default | accepts | meaning |",
        "|---|---|---|---|",
    ]
    for field in Settings.model_fields.values():
        name = field.alias
        description = hub.get(name) or LOCAL_ONLY.get(name)
        if description is None:
            raise SystemExit(f"{name} (worker/settings.py) has no entry in .runpod/hub.json: add one")
        lines.append(f"| `{name}` | {shown_default(field.default)} | {accepts(field)} | {description} |")
    lines += [
        "",
        "## Build arguments",
        "",
        "Passed to `docker build` as `--build-arg NAME=value`; they decide what the image contains.",
        "",
        "| argument | default | meaning |",
        "|---|---|---|",
    ]
    for name, default, description in build_args(docker):
        lines.append(f"| `{name}` | {f'`{default}`' if default else 'empty'} | {description} |")
    for name, description in secrets(docker):
        lines.append(f"| `{name}` (secret) | none | {description} |")
    lines += [
        "",
        "## Set by the image",
        "",
        "| variable | value | why |",
        "|---|---|---|",
        *[f"| `{name}` | {value} | {image_env_meaning(name)} |" for name, value in image_env(docker)],
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if not OUTPUT.is_file() or OUTPUT.read_text() != text:
            print(f"{OUTPUT.relative_to(ROOT)} is out of date: run python docs/gen_configuration.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
