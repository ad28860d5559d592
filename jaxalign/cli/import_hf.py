"""`jaxalign import-hf`: convert a transformers checkpoint directory to a jaxalign (orbax) checkpoint."""

from __future__ import annotations

from jaxalign.checkpoint import save_model
from jaxalign.interop import hf
from jaxalign.loading import check_transformers_config


def run(args) -> int:
    """Load the transformers checkpoint and save it with `jaxalign.checkpoint.save_model` (a config.json lacking a
    field its family needs is named, as every command names it)."""
    check_transformers_config(args.directory)
    model = hf.load(args.directory)
    out = save_model(model, args.out, overwrite=args.overwrite)
    print(f"imported {model.config.family} ({model.config.fingerprint()}) from {args.directory} -> {out}")
    return 0


def add_parser(sub) -> None:
    """Add the `import-hf` subcommand."""
    p = sub.add_parser("import-hf", help="convert a transformers checkpoint directory to a jaxalign (orbax) "
                                         "checkpoint")
    p.add_argument("directory", help="directory with config.json and model.safetensors (or a sharded index)")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.set_defaults(func=run)
