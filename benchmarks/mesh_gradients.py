"""Are aligned gradients the same on a mesh as on one device, beyond the tests' inputs? A sweep over models and
seeds: the gradient of the token-mean loss (`numerics.reduce.mean` of the per-token logprobs) on one device and
on a mesh, leaf by leaf.

    python benchmarks/mesh_gradients.py [--presets countdown,tiny] [--seeds 0,1,2] [--mesh data=2]
                                        [--policy aligned-bf16] [--tokens 8x38]

`aligned-bf16` promises one device's bits on any mesh (`cross_device=ordered`, tree reductions); the multidevice
tests check it on `tiny` with one set of weights and tokens. Each row here is one (preset, seed): fresh weights
from `nnx.Rngs(seed)` and uniform random tokens from the same seed; it reports whether the loss is identical,
how many gradient leaves differ, and the leaf with the largest difference. Runs on 8 fake CPU devices (set before
JAX starts). Writes benchmarks/results/mesh_gradients.json (`--out` elsewhere).
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default="countdown,tiny")
    parser.add_argument("--seeds", default="0,1,2,3")
    parser.add_argument("--mesh", default="data=2")
    parser.add_argument("--policy", default="aligned-bf16")
    parser.add_argument("--tokens", default="8x38", help="batch x sequence length")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "mesh_gradients.json"))
    args = parser.parse_args(argv)
    try:
        batch, seq = (int(v) for v in args.tokens.split("x"))
        seeds = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        parser.error(f"--tokens {args.tokens!r} / --seeds {args.seeds!r}: expected e.g. 8x38 and 0,1,2")
    if min(batch, seq) < 1 or not seeds:
        parser.error("--tokens needs a positive batch and length, --seeds at least one seed")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    os.environ["XLA_FLAGS"] = " ".join(flags + ["--xla_force_host_platform_device_count=8"])
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import jaxalign as ja
    from jaxalign import report
    from jaxalign.model.scoring import sequence_logprobs
    from jaxalign.model.sharding import make_mesh, shard_state
    from jaxalign.numerics.reduce import mean
    try:
        policy = ja.NumericPolicy.parse(args.policy)
        mesh = make_mesh(args.mesh)
        presets = [p for p in args.presets.split(",") if p]
        for name in presets:
            ja.ModelConfig.preset(name)  # an unknown preset: its error names the allowed ones
    except ValueError as err:
        parser.error(str(err))
    rows = []
    for preset in presets:
        for seed in seeds:
            model = ja.Transformer(ja.ModelConfig.preset(preset), rngs=nnx.Rngs(seed))
            tokens = jnp.asarray(np.random.default_rng(seed).integers(0, model.config.vocab_size, (batch, seq)),
                                 jnp.int32)
            graphdef, state = nnx.split(model)

            def loss_and_grads(s, graphdef=graphdef, tokens=tokens):
                def loss(s):
                    return -mean(sequence_logprobs(nnx.merge(graphdef, s), tokens, policy)[0], policy)
                return jax.value_and_grad(loss)(s)
            one_loss, one = jax.jit(loss_and_grads)(state)
            with jax.set_mesh(mesh):
                mesh_loss, meshed = jax.jit(loss_and_grads)(shard_state(state, mesh))
            differing, worst = [], ("", 0.0)
            for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(one)[0], jax.tree.leaves(meshed)):
                a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
                if not np.array_equal(a, b):
                    name = jax.tree_util.keystr(path).replace(".value", "")
                    differing.append(name)
                    if np.abs(a - b).max() > worst[1]:
                        worst = (name, float(np.abs(a - b).max()))
            rows.append({"preset": preset, "seed": seed, "loss_identical": float(one_loss) == float(mesh_loss),
                         "leaves": len(jax.tree.leaves(one)), "leaves_differing": len(differing),
                         "largest": f"{worst[0]} {worst[1]:.2e}" if differing else "", "differing": differing})
            print(f"{preset} seed {seed}: {len(differing)} leaves differ", flush=True)
    sys.path.insert(0, HERE)
    from common import write_json
    text = report.table(rows, ["preset", "seed", "loss_identical", "leaves", "leaves_differing", "largest"])
    print(text)
    write_json(args.out, {"args": vars(args), "rows": rows, "tables": {"mesh_gradients": text}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
