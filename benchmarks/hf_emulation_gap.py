"""How close `hf.emulation_policy(family, path)` lands to transformers' bf16 forward, per family: k3 of the
emulation against each of transformers' two expert paths (eager, grouped_mm), the gap between those paths, and
their ratio -- the figures behind `EMULATION_FACTOR_BY_CAPABILITY` in tests/test_hf_interop.py and docs/families.md's
table. The models, tokens and replay are the test's (each side replays the experts, and for GLM-5 the indexer
keys, that its transformers path picked). Needs the `hf` extra. Prints a table and writes JSON.

    python benchmarks/hf_emulation_gap.py [--families deepseek_v3,glm_moe_dsa] [--override mla=absorbed]

torch's CPU kernels (and with them the order it sums an RMSNorm's squares) follow the host's best instruction set;
`ATEN_CPU_CAPABILITY=avx2` or `=default` in the environment measures a lower one (the JSON records which ran).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import torch  # noqa: E402
import transformers  # noqa: E402

import jaxalign as ja  # noqa: E402
import test_hf_interop as cases  # noqa: E402  (the test's models and helpers)
from common import write_json  # noqa: E402
from jaxalign.metrics.mismatch import mismatch_metrics  # noqa: E402
from jaxalign.interop import hf  # noqa: E402

PATHS = ("eager", "grouped_mm")


def family_rows(family: str, override: str, work: str) -> list[dict]:
    """One row per transformers path for `family`."""
    path = os.path.join(work, family)
    cases.hf_model(family).save_pretrained(path)
    ours = hf.load(path)
    tokens = cases._tokens(8, 48)
    lp, routes, index = {}, {}, {}
    for impl in PATHS:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.bfloat16, experts_implementation=impl, attn_implementation="eager").eval()
        logits, routes[impl] = cases._hf_forward(model, tokens)
        lp[impl] = cases._next_token_lp(logits, tokens)
        index[impl] = cases._visible(cases._hf_index_selections(model, tokens)[1]) if family == "glm_moe_dsa" else None
    mask = np.ones(lp["eager"].shape, bool)
    gap = mismatch_metrics(lp["eager"], lp["grouped_mm"], mask)["k3_kl"]
    rows = []
    for impl in PATHS:
        policy = hf.emulation_policy(family, impl)
        if override:
            policy = ja.NumericPolicy.parse(f"{policy.compact()},{override}")
        ours_lp, _ = ja.token_logprobs(ours, tokens, policy, replay=routes[impl], index_replay=index[impl])
        k3 = mismatch_metrics(np.asarray(ours_lp), lp[impl], mask)["k3_kl"]
        rows.append({"family": family, "path": impl, "policy": policy.compact(), "k3_kl": k3,
                     "gap_between_hf_paths": gap, "ratio": gap / k3 if k3 > 0 else float("inf")})
        print(f"{family:12s} {impl:10s} k3 {k3:.3e}  gap {gap:.3e}  gap/k3 {rows[-1]['ratio']:.3g}", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", default=",".join(cases.FAMILIES))
    parser.add_argument("--override", default="", help="policy fields added to every emulation policy")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "hf_emulation_gap.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as work:
        for family in args.families.split(","):
            rows += family_rows(family, args.override, work)
    write_json(args.out, {"override": args.override, "xla_flags": os.environ.get("XLA_FLAGS", ""),
                          "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
                          "transformers": transformers.__version__, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
