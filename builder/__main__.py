"""`python -m builder`: bake MODEL_NAME (hub id, folder, .gguf, or the bundled default) into BASE_PATH/model,
with the LoRA adapters LORA_MODULES names beside it, and the draft model or EAGLE-3 head SPECULATIVE_CONFIG names
on the hub into BASE_PATH/speculative."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from builder.adapters import parse_lora_modules
from builder.bake import bake, is_current_bake, source_change, update_adapters
from builder.errors import BakeError
from builder.overrides import parse_hf_overrides
from builder.sources import resolve
from builder.speculative import bake_speculative, check_mtp, speculative_repo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m builder", description=__doc__)
    parser.add_argument(
        "--model",
        default=os.environ.get("MODEL_NAME", ""),
        help="hub repo id, local folder or .gguf file; empty: the bundled SmolLM2-135M-Instruct",
    )
    parser.add_argument("--revision", default=os.environ.get("MODEL_REVISION") or None)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("BASE_PATH", "/models")) / "model")
    parser.add_argument("--served-name", default=None, help="name the worker serves (default: the source's)")
    parser.add_argument(
        "--lora-modules",
        default=os.environ.get("LORA_MODULES", ""),
        help='LoRA adapters: a JSON list of {"name", "path", "base_model_name"?}, or name=path pairs',
    )
    parser.add_argument(
        "--speculative-config",
        default=os.environ.get("SPECULATIVE_CONFIG", ""),
        help="vLLM's speculative_config JSON: a draft_model or eagle3 `model` on the hub is baked "
        "into BASE_PATH/speculative; mtp: the model must ship its mtp.* head",
    )
    parser.add_argument(
        "--hf-overrides",
        default=os.environ.get("HF_OVERRIDES", ""),
        help="a JSON object of config.json keys to set on the baked model (vLLM's --hf-overrides)",
    )
    parser.add_argument(
        "--if-missing",
        action="store_true",
        help="keep the model OUT already holds when it is a bake of --model (and --revision) in "
        "this builder's format (bake only adapters it lacks from --lora-modules); else re-bake",
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print what the model baked in OUT needs on a GPU (weights, KV per token, context that "
        "fits on 24 / 48 / 80 / 141 GB at GPU_MEMORY_UTILIZATION) and bake nothing",
    )
    args = parser.parse_args(argv)
    if args.plan:
        return print_plan(args.out)

    token = os.environ.get("HF_TOKEN")
    try:
        status = bake_model(args, token)
        speculative = speculative_repo(args.speculative_config)
        if status == 0 and speculative is not None:
            print(bake_speculative(*speculative, args.out.parent, args.out, token, if_missing=args.if_missing))
        found = check_mtp(args.speculative_config, args.out) if status == 0 else None
        if found is not None:
            print(found)
    except BakeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return status


def bake_model(args: argparse.Namespace, token: str | None) -> int:
    """The model and its adapters (kept when --if-missing finds them baked); BakeError in one line."""
    adapters = parse_lora_modules(args.lora_modules)
    source = dataclasses.replace(resolve(args.model, args.revision), hf_overrides=parse_hf_overrides(args.hf_overrides))
    if args.if_missing and is_current_bake(args.out):
        change = source_change(args.out, source)
        if change is None:
            updated = update_adapters(args.out, adapters, token) if adapters else None
            print(
                f"model already baked in {args.out}"
                + (f"; adapters now {', '.join(a['name'] for a in updated['adapters'])}" if updated else "")
            )
            return 0
        print(f"re-baking {args.out}: {change}")
    manifest = bake(source, args.out, token=token, served_name=args.served_name, adapters=adapters)
    names = "".join(f" + adapter {a['name']} (rank {a['rank']})" for a in manifest["adapters"])
    sizes = ", ".join(map(str, manifest["tensor_parallel_sizes"]))
    print(
        f"baked {manifest['served_model_name']} ({manifest['architecture']}, {manifest['dtype']}){names} "
        f"into {args.out} (tensor-parallel sizes: {sizes})"
    )
    return 0


def print_plan(folder: Path) -> int:
    """The memory plan of the bake in `folder`, served as the worker's settings say (DTYPE, KV_CACHE_DTYPE,
    GPU_MEMORY_UTILIZATION, MAX_NUM_SEQS, MAX_NUM_BATCHED_TOKENS; on a GPU, DTYPE=auto is bfloat16)."""
    import torch

    from engine.errors import UnsupportedModel
    from engine.model.memory_plan import describe, plan_for_folder

    dtypes = {"float32": torch.float32, "float16": torch.float16}
    dtype = dtypes.get(os.environ.get("DTYPE", "auto").lower(), torch.bfloat16)
    kv = torch.float8_e4m3fn if os.environ.get("KV_CACHE_DTYPE", "auto").lower().startswith("fp8") else None
    try:
        plan = plan_for_folder(
            str(folder),
            dtype,
            kv,
            max_num_seqs=int(os.environ.get("MAX_NUM_SEQS", 256)),
            max_num_batched_tokens=int(os.environ.get("MAX_NUM_BATCHED_TOKENS", 2048)),
        )
    except (UnsupportedModel, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(
        f"memory plan of {folder} in {str(dtype).removeprefix('torch.')}"
        f"{', KV in float8_e4m3fn' if kv is not None else ''}:"
    )
    for line in describe(plan, float(os.environ.get("GPU_MEMORY_UTILIZATION", 0.9))):
        print("  " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
