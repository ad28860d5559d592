"""`jaxalign policies`: every policy preset with all its fields."""

from __future__ import annotations

from jaxalign import report
from jaxalign.numerics import FIELDS, PRESETS


def run(args) -> int:
    """Print the presets as a table (or JSON) and the fields' allowed values."""
    if args.json:
        print(report.to_json({name: p.to_dict() | {"string": str(p)} for name, p in PRESETS.items()}))
        return 0
    rows = [{"field": f"{name} ({spec.key})", **{p: PRESETS[p].to_dict()[name] for p in PRESETS}}
            for name, spec in FIELDS.items()]
    print(report.table(rows, ["field", *PRESETS]))
    print("\nFields:")
    for name, spec in FIELDS.items():
        print(f"  {spec.key:<15} {spec.allowed:<40} {spec.doc}")
    return 0


def add_parser(sub) -> None:
    """Add the `policies` subcommand."""
    p = sub.add_parser("policies", help="print every policy preset with all its fields")
    p.add_argument("--json", action="store_true", help="one JSON object: preset -> fields")
    p.set_defaults(func=run)
