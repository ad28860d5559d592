"""The trainer-engine gap without training: misaligned, misaligned + R3 replay, aligned, on the `small` model,
at engine batch 1 and 8 and with continuous batching. Prints the table of docs/gap.md and writes the JSON the
README's gap table is generated from (benchmarks/readme_tables.py).

    python benchmarks/gap_table.py [--prompts 32] [--new-tokens 48]
"""

from __future__ import annotations

import argparse
import os
import sys

from flax import nnx

sys.path.insert(0, os.path.dirname(__file__))
import jaxalign as ja  # noqa: E402
from common import write_json  # noqa: E402
from jaxalign import report  # noqa: E402
from jaxalign.align.compare import compare  # noqa: E402

ARMS = [("misaligned", "train-bf16", "serve-bf16", "none"),
        ("misaligned + R3 replay", "train-bf16", "serve-bf16", "r3"),
        ("aligned", "aligned-bf16", "aligned-bf16", "none")]
COLUMNS = ["arm", "schedule", "engine_batch", "k3_kl", "kl", "max_abs_logp_diff", "bitwise_equal_fraction",
           "route_flip_rate", "route_token_any_flip"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--out", default="benchmarks/results/gap_table.json")
    args = parser.parse_args(argv)
    model = ja.Transformer(ja.ModelConfig.preset(args.model), rngs=nnx.Rngs(0))
    rows = []
    for arm, trainer, engine, replay in ARMS:
        for schedule, batches in (("static", (1, 8)), ("continuous", (8,))):
            result = compare(model, ja.NumericPolicy.preset(trainer), ja.NumericPolicy.preset(engine),
                             replay=replay, n_prompts=args.prompts, max_new_tokens=args.new_tokens,
                             engine_batches=batches, schedule=schedule, seed=0)
            rows += [{"arm": arm, "schedule": schedule, **run} for run in result["runs"]]
    print(report.table(rows, COLUMNS))
    write_json(args.out, {"args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
