"""What travels between CPUs: one probe run natively and under `XLA_FLAGS=--xla_cpu_max_isa=AVX2 / AVX / SSE4_2`
(each in its own process, on 2 fake devices), compared with the native run. The table is in docs/policies.md.

Per preset the probe computes teacher-forced per-token logprobs, the loss (`numerics.reduce.mean` of them) and
its gradients, and greedy generation (tokens and engine logprobs); within each ISA it checks trainer == engine
(the engine's logprobs vs the trainer's on the generated tokens) and one device == a `tensor=2` mesh (logprobs),
bitwise. Across ISAs it reports, per quantity, whether the bits are identical and the max |delta|.

    python benchmarks/cross_host.py [--model tiny] [--presets fp32,aligned-bf16,serve-bf16] [--isas AVX2,AVX,SSE4_2]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
QUANTITIES = ("logprobs", "loss", "grads", "tokens", "engine_logprobs")


def probe(model_name: str, presets: list[str], out: str) -> None:
    """Run every quantity for every preset in this process; write them (and the within-ISA checks) to `out`."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxalign import ModelConfig, NumericPolicy, Transformer, generate, make_mesh
    from jaxalign.model.scoring import sequence_logprobs, token_logprobs
    from jaxalign.numerics.reduce import mean

    model = Transformer(ModelConfig.preset(model_name), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, model.config.vocab_size, (4, 24)).astype(np.int32)
    prompts = [list(row[: 5 + i]) for i, row in enumerate(tokens)]
    graphdef, state = nnx.split(model)
    arrays, checks = {}, {}
    for name in presets:
        policy = NumericPolicy.preset(name)

        def loss(s, policy=policy):
            lp, _ = sequence_logprobs(nnx.merge(graphdef, s), jnp.asarray(tokens), policy)
            return -mean(lp, policy)
        lp = np.asarray(token_logprobs(model, tokens, policy)[0])
        value, grads = jax.jit(jax.value_and_grad(loss))(state)
        rollout = generate(model, prompts, policy, max_new_tokens=8, temperature=0.0)
        rescored = np.asarray(token_logprobs(model, rollout.tokens, policy)[0])
        meshed = np.asarray(token_logprobs(model, tokens, policy, mesh=make_mesh("tensor=2"))[0])
        arrays.update({f"{name}/logprobs": lp, f"{name}/loss": np.asarray(value),
                       f"{name}/grads": np.concatenate([np.asarray(g, np.float32).ravel()
                                                        for g in jax.tree.leaves(grads)]),
                       f"{name}/tokens": rollout.tokens, f"{name}/engine_logprobs": rollout.logprobs[rollout.mask]})
        engine = rollout.logprobs[rollout.mask]
        checks[name] = {"trainer_eq_engine": bool(np.array_equal(rescored[rollout.mask], engine)),
                        "one_device_eq_mesh": bool(np.array_equal(meshed, lp))}
    np.savez(out, **arrays)
    with open(out + ".json", "w") as f:
        json.dump(checks, f)


def run_probe(isa: str, args, tmp: str) -> tuple[dict, dict, float]:
    """The probe in a fresh process under `isa` ('native' = no cap): (arrays, within-ISA checks, seconds)."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith(("--xla_cpu_max_isa", "--xla_force_host_platform_device_count"))]
    flags.append("--xla_force_host_platform_device_count=2")
    if isa != "native":
        flags.append(f"--xla_cpu_max_isa={isa}")
    out = os.path.join(tmp, f"{isa}.npz")
    start = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--probe", out, "--model", args.model, "--presets", args.presets],
                   env=dict(os.environ, XLA_FLAGS=" ".join(flags)), check=True)
    with np.load(out) as data, open(out + ".json") as f:
        return {k: data[k] for k in data.files}, json.load(f), time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--presets", default="fp32,aligned-bf16,serve-bf16")
    ap.add_argument("--isas", default="AVX2,AVX,SSE4_2")
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cross_host.json"))
    args = ap.parse_args()
    presets = args.presets.split(",")
    if args.probe:
        return probe(args.model, presets, args.probe)

    sys.path.insert(0, HERE)
    from common import write_json
    isas = ["native"] + args.isas.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        runs = {isa: run_probe(isa, args, tmp) for isa in isas}
    native = runs["native"][0]
    rows = []
    for isa in isas:
        arrays, checks, seconds = runs[isa]
        for name in presets:
            row = {"isa": isa, "preset": name, **checks[name], "seconds": round(seconds, 1)}
            for q in QUANTITIES:
                a, b = arrays[f"{name}/{q}"], native[f"{name}/{q}"]
                same_shape = a.shape == b.shape
                row[f"{q}_identical"] = bool(same_shape and np.array_equal(a, b))
                if q == "tokens":
                    row["tokens_same_fraction"] = float(np.mean(a == b)) if same_shape else 0.0
                else:
                    row[f"{q}_max_abs_diff"] = (float(np.max(np.abs(a.astype(np.float64) - b)))
                                                if same_shape and a.size else None)
            rows.append(row)
    print(f"{'isa':8} {'preset':13} {'trainer=engine':>14} {'1dev=mesh':>9} " +
          " ".join(f"{q:>16}" for q in QUANTITIES))
    for r in rows:
        cells = [("identical" if r[f"{q}_identical"] else
                  (f"{r['tokens_same_fraction']:.3f} same" if q == "tokens" else f"{r[f'{q}_max_abs_diff']:.2e}"))
                 for q in QUANTITIES]
        print(f"{r['isa']:8} {r['preset']:13} {str(r['trainer_eq_engine']):>14} {str(r['one_device_eq_mesh']):>9} " +
              " ".join(f"{c:>16}" for c in cells))
    with open("/proc/cpuinfo") if os.path.exists("/proc/cpuinfo") else open(os.devnull) as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    write_json(args.out, {"cpu": cpu, "model": args.model, "rows": rows})


if __name__ == "__main__":
    main()
