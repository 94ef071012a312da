"""`python -m builder`: bake MODEL_NAME (hub id, folder, .gguf, or the bundled default) into BASE_PATH/model."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from builder.bake import bake, is_current_bake
from builder.errors import BakeError
from builder.sources import resolve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m builder", description=__doc__)
    parser.add_argument("--model", default=os.environ.get("MODEL_NAME", ""),
                        help="hub repo id, local folder or .gguf file; empty: the bundled SmolLM2-135M-Instruct")
    parser.add_argument("--revision", default=os.environ.get("MODEL_REVISION") or None)
    parser.add_argument("--out", type=Path,
                        default=Path(os.environ.get("BASE_PATH", "/models")) / "model")
    parser.add_argument("--served-name", default=None, help="name the worker serves (default: the source's)")
    parser.add_argument("--if-missing", action="store_true",
                        help="do nothing when OUT already holds a bake (of this builder's format)")
    args = parser.parse_args(argv)

    if args.if_missing and is_current_bake(args.out):
        print(f"model already baked in {args.out}")
        return 0
    try:
        source = resolve(args.model, args.revision)
        manifest = bake(source, args.out, token=os.environ.get("HF_TOKEN"), served_name=args.served_name)
    except BakeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"baked {manifest['served_model_name']} ({manifest['architecture']}, {manifest['dtype']}) into {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
