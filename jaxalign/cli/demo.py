"""`jaxalign demo`: Countdown RL from one warm start, aligned vs misaligned trainer/engine numerics."""

from __future__ import annotations

from jaxalign.cli.args import output_dir
from jaxalign.demo import run_demo


def run(args) -> int:
    """Run the demo (`jaxalign.demo.run_demo`)."""
    return run_demo(out_dir=output_dir(args.out), json_out=args.json, quick=args.quick)


def add_parser(sub) -> None:
    """Add the `demo` subcommand."""
    p = sub.add_parser("demo", help="the main job: Countdown RL from one warm start, aligned vs misaligned "
                                    "trainer/engine numerics (~3 min on 2 CPU cores)")
    p.add_argument("--out", default="runs/demo", help="output directory (resumes the runs found there)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--quick", action="store_true", help="a much smaller run (used by the tests)")
    p.set_defaults(func=run)
