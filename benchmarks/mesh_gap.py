"""The gap that parallelism opens, on 8 fake CPU devices. Two tables (both in docs/scaling.md):

1. `compare` (engine generates, trainer scores) with trainer and engine under the same policy, the trainer on
   one device and the engine tensor-, expert- or data-parallel (and two differently parallelised pairs).
2. Parallelism alone: the same teacher-forced forward on a mesh vs on one device, per policy.

serve-bf16 / train-bf16 / fp32 show the partitioner's all-reduces changing bits; aligned-bf16
(cross_device=ordered) stays bitwise, and aligned-bf16 with cross_device=xla does not. Writes JSON.

    python benchmarks/mesh_gap.py [--model small] [--prompts 16] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
import jaxalign as ja  # noqa: E402
from common import write_json  # noqa: E402
from jaxalign import report  # noqa: E402
from jaxalign.align.compare import compare  # noqa: E402

PAIRS = [(None, None), (None, "tensor=2"), (None, "tensor=4"), (None, "tensor=8"), (None, "expert=2"),
         (None, "expert=4"), (None, "expert=8"), (None, "data=8"), ("fsdp=4,tensor=2", "tensor=8"),
         ("data=2,expert=2,tensor=2", "expert=8")]
COLUMNS = ["policy", "trainer_mesh", "engine_mesh", "k3_kl", "kl", "max_abs_logp_diff", "bitwise_equal_fraction",
           "route_flip_rate"]
FORWARD_MESHES = ["tensor=2", "tensor=4", "tensor=8", "expert=2", "expert=4", "expert=8", "data=8",
                  "fsdp=4,tensor=2", "data=2,expert=2,tensor=2"]
FORWARD_POLICIES = ["fp32", "train-bf16", "serve-bf16", "aligned-bf16,xdev=xla", "aligned-bf16"]
FORWARD_COLUMNS = ["policy", "mesh", "k3_kl", "max_abs_logp_diff", "bitwise_equal_fraction", "route_flip_rate"]


def parallelism_alone(model, n_seqs: int, length: int) -> list[dict]:
    """Teacher-forced logprobs and routes of random sequences on each mesh vs one device."""
    import numpy as np

    from jaxalign.metrics.mismatch import mismatch_metrics
    from jaxalign.metrics.routing import routing_metrics
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (n_seqs, length)).astype(np.int32)
    mask = np.ones((n_seqs, length - 1), bool)
    rows = []
    for name in FORWARD_POLICIES:
        policy = ja.NumericPolicy.parse(name)
        lp_one, rec_one = ja.token_logprobs(model, tokens, policy)
        for spec in FORWARD_MESHES:
            lp, rec = ja.token_logprobs(model, tokens, policy, mesh=ja.make_mesh(spec))
            m = mismatch_metrics(np.asarray(lp), np.asarray(lp_one), mask)
            rows.append({"policy": name, "mesh": spec, "k3_kl": m["k3_kl"],
                         "max_abs_logp_diff": m["max_abs_logp_diff"],
                         "bitwise_equal_fraction": m["bitwise_equal_fraction"],
                         "route_flip_rate": routing_metrics(np.asarray(rec_one.indices),
                                                            np.asarray(rec.indices))["route_flip_rate"]})
            print(report.table(rows[-1:], FORWARD_COLUMNS), flush=True)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--policies", default="serve-bf16,aligned-bf16")
    parser.add_argument("--out", default="benchmarks/results/mesh_gap.json")
    args = parser.parse_args(argv)
    model = ja.Transformer(ja.ModelConfig.preset(args.model), rngs=nnx.Rngs(0))
    rows = []
    for name in args.policies.split(","):
        policy = ja.NumericPolicy.parse(name)
        for trainer_spec, engine_spec in PAIRS:
            result = compare(model, policy, policy, n_prompts=args.prompts, max_new_tokens=args.new_tokens,
                             engine_batches=(8,), trainer_mesh=trainer_spec and ja.make_mesh(trainer_spec),
                             engine_mesh=engine_spec and ja.make_mesh(engine_spec))
            run = result["runs"][0]
            rows.append({"policy": name, "trainer_mesh": result["trainer_mesh"],
                         "engine_mesh": result["engine_mesh"], **{c: run[c] for c in COLUMNS[3:]}})
            print(report.table(rows[-1:], COLUMNS), flush=True)
    forward_rows = parallelism_alone(model, args.prompts, 64)
    print(f"\n{args.model} model, {args.prompts} prompts x {args.new_tokens} new tokens, engine batch 8, "
          f"trainer and engine under the same policy:")
    print(report.table(rows, COLUMNS))
    print(f"\nparallelism alone: teacher-forced forward of {args.prompts} x 64 random tokens, mesh vs one device:")
    print(report.table(forward_rows, FORWARD_COLUMNS))
    write_json(args.out, {"model": args.model, "prompts": args.prompts, "new_tokens": args.new_tokens,
                          "compare_rows": rows, "forward_rows": forward_rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
