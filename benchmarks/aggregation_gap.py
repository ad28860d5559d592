"""The seed's Qwen3.5-MoE aggregation finding on `tiny-qwen3.5` in bf16: the gap between the three ways of summing
the k weighted expert outputs (`jaxalign.numerics.experts.AGGREGATION_PATHS`: eager, grouped, f32) at top-2, 4
and 8 of 8 experts, each pair scored teacher-forced on the same tokens; then what `localize` names for eager
against grouped, and the gap left when the MoE blocks take the reference path. Prints the tables and writes
JSON (rows, settings, code fingerprint); the README's `aggregation` table and notebook 04 come from it.

    python benchmarks/aggregation_gap.py [--model tiny-qwen3.5] [--top-ks 2,4,8] [--prompts 16] [--new-tokens 24]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
import jaxalign as ja  # noqa: E402
from common import write_json  # noqa: E402
from jaxalign import report  # noqa: E402
from jaxalign.align.aggregation import aggregation_gap  # noqa: E402
from jaxalign.rl.rundir import code_fingerprint  # noqa: E402

OUT = os.path.join(os.path.dirname(__file__), "results", "aggregation_gap.json")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-qwen3.5", help="a model preset with routed experts")
    parser.add_argument("--base", default="hf-grouped-bf16", help="the policy every path starts from")
    parser.add_argument("--top-ks", default="2,4,8", help="comma-separated top-k values")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--out", default=OUT)
    args = parser.parse_args(argv)
    top_ks = tuple(int(k) for k in args.top_ks.split(","))
    result = aggregation_gap(ja.ModelConfig.preset(args.model), ja.NumericPolicy.parse(args.base), top_ks=top_ks,
                             n_prompts=args.prompts, max_new_tokens=args.new_tokens)
    print(report.table(result["rows"], ["top_k", "trainer_path", "engine_path", "k3_kl", "max_abs_logp_diff",
                                        "bitwise_equal_fraction", "route_flip_rate"]))
    print()
    print(report.table(result["localize"], ["top_k", "trainer_path", "engine_path", "k3_kl", "culprit",
                                            "k3_moe_from_trainer", "k3_attn_from_trainer"]))
    write_json(args.out, {"preset": args.model, "base_name": args.base, "code": code_fingerprint(), **result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
