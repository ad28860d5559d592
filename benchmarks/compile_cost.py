"""What a program costs to compile under each policy: fusions in the optimized HLO and XLA:CPU compile seconds.

    python benchmarks/compile_cost.py [--policies "fp32;aligned-bf16"] [--model tiny] [--layers 2,1]

For each policy and layer count, the jitted gradient of the summed token logprobs (the trainer's program) on
[8, 24] tokens of the model is lowered and compiled once, fresh (the persistent compilation cache is switched
off), and the fusions of the compiled module counted; each row also has the compile's process CPU seconds (XLA
compiles on several threads), the median of 5 runs of the compiled gradient and `bits`, a hash of what it
computes, so a compiler setting shows what it costs at run time and whether the numbers changed with it. The
suite's time is mostly this compile (docs/testing.md).
Writes benchmarks/results/compile_cost.json (`--out` elsewhere), with the XLA_FLAGS it ran under: e.g.
`XLA_FLAGS=--xla_cpu_opt_preset=CPU_OPT_PRESET_FAST_COMPILE python benchmarks/compile_cost.py --out ...` measures
a compiler setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import write_json  # noqa: E402,I001


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="fp32;aligned-bf16", help="';'-separated policies")
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--layers", default="2,1", help="comma-separated layer counts")
    parser.add_argument("--out", default="benchmarks/results/compile_cost.json")
    args = parser.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import jaxalign as ja
    from jaxalign import report
    from jaxalign.model.scoring import sequence_logprobs
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        policies = {p: ja.NumericPolicy.parse(p) for p in args.policies.split(";") if p}
        layers = [int(n) for n in args.layers.split(",")]
    except ValueError as exc:
        parser.error(str(exc))
    rows = []
    for n_layers in layers:
        cfg = dataclasses.replace(ja.ModelConfig.preset(args.model), n_layers=n_layers)
        graphdef, state = nnx.split(ja.Transformer(cfg, rngs=nnx.Rngs(0)))
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (8, 24)), jnp.int32)
        for name, policy in policies.items():
            grad = jax.jit(jax.grad(lambda s, t, p=policy: sequence_logprobs(nnx.merge(graphdef, s), t, p)[0].sum()))
            lowered = grad.lower(state, tokens)
            start, cpu_start = time.perf_counter(), time.process_time()
            compiled = lowered.compile()
            seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
            fusions = len(re.findall(r"^\s*%?[\w.\-]+ = \S+ fusion\(", compiled.as_text(), re.M))
            leaves = jax.tree.leaves(compiled(state, tokens))
            bits = hashlib.sha256(b"".join(np.asarray(leaf).tobytes() for leaf in leaves)).hexdigest()[:12]
            runs = []
            for _ in range(5):
                start = time.perf_counter()
                jax.block_until_ready(compiled(state, tokens))
                runs.append(time.perf_counter() - start)
            rows.append({"policy": name, "model": args.model, "n_layers": n_layers, "fusions": fusions,
                         "compile_s": seconds, "compile_cpu_s": cpu_seconds, "run_ms": 1e3 * float(np.median(runs)),
                         "bits": bits})
            print(report.table(rows[-1:], list(rows[-1])), flush=True)
    table = report.table(rows, ["policy", "model", "n_layers", "fusions", "compile_s", "compile_cpu_s", "run_ms",
                                "bits"])
    print(table)
    write_json(args.out, {"args": vars(args), "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": rows,
                          "tables": {"compile_cost": table}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
