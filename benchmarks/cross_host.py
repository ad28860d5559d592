"""What travels between CPUs: one probe run natively and under `XLA_FLAGS=--xla_cpu_max_isa=AVX2 / AVX / SSE4_2`
(each in its own process, on 2 fake devices), compared with the native run. The table is in docs/policies.md.

Per preset the probe computes teacher-forced per-token logprobs, the loss (`numerics.reduce.mean` of them) and
its gradients, and greedy generation (tokens and engine logprobs); within each ISA it checks trainer == engine
(the engine's logprobs vs the trainer's on the generated tokens) and one device == a `tensor=2` mesh (logprobs),
bitwise. Across ISAs it reports, per quantity, whether the bits are identical and the max |delta|.

    python benchmarks/cross_host.py [--model tiny] [--presets fp32,aligned-bf16,serve-bf16] [--isas AVX2,AVX,SSE4_2]
                                    [--keep DIR]
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


def run_probe(isa: str, args, tmp: str) -> tuple[dict, dict, float | None]:
    """The probe in a fresh process under `isa` ('native' = no cap): (arrays, within-ISA checks, seconds).
    With `--keep DIR` the probe's files stay in DIR, and a probe already there is read instead of rerun."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith(("--xla_cpu_max_isa", "--xla_force_host_platform_device_count"))]
    flags.append("--xla_force_host_platform_device_count=2")
    if isa != "native":
        flags.append(f"--xla_cpu_max_isa={isa}")
    out = os.path.join(args.keep or tmp, f"{isa}.npz")
    if args.keep and os.path.exists(out + ".json"):
        with np.load(out) as data, open(out + ".json") as f:
            return {k: data[k] for k in data.files}, json.load(f), None
    start = time.perf_counter()
    subprocess.run([sys.executable, __file__, "--probe", out, "--model", args.model, "--presets", args.presets],
                   env=dict(os.environ, XLA_FLAGS=" ".join(flags)), check=True)
    with np.load(out) as data, open(out + ".json") as f:
        return {k: data[k] for k in data.files}, json.load(f), time.perf_counter() - start


def _cell(row: dict, q: str) -> str:
    """One table cell: identical, the fraction of equal tokens, or the max |delta| (n/a if the shapes differ)."""
    if row[f"{q}_identical"]:
        return "identical"
    if q == "tokens":
        return f"{row['tokens_same_fraction']:.3f} same"
    diff = row[f"{q}_max_abs_diff"]
    return "n/a (other tokens)" if diff is None else f"{diff:.2e}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--presets", default="fp32,aligned-bf16,serve-bf16")
    ap.add_argument("--isas", default="AVX2,AVX,SSE4_2")
    ap.add_argument("--keep", help="keep (and reuse) each ISA's probe files in this folder")
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "cross_host.json"))
    args = ap.parse_args()
    presets = args.presets.split(",")
    if args.probe:
        return probe(args.model, presets, args.probe)

    sys.path.insert(0, HERE)
    from common import write_json
    isas = ["native"] + [isa for isa in args.isas.split(",") if isa]
    with tempfile.TemporaryDirectory() as tmp:
        runs = {isa: run_probe(isa, args, tmp) for isa in isas}
    native = runs["native"][0]
    rows = []
    for isa in isas:
        arrays, checks, seconds = runs[isa]
        for name in presets:
            row = {"isa": isa, "preset": name, **checks[name],
                   "probe_seconds": None if seconds is None else round(seconds, 1)}
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
    print("| ISA | preset | trainer == engine | 1 device == tensor=2 | " + " | ".join(QUANTITIES) + " |")
    print("|---" * (4 + len(QUANTITIES)) + "|")
    for r in rows:
        cells = [_cell(r, q) for q in QUANTITIES]
        print(f"| {r['isa']} | {r['preset']} | {'bitwise' if r['trainer_eq_engine'] else 'no'} | "
              f"{'bitwise' if r['one_device_eq_mesh'] else 'no'} | " + " | ".join(cells) + " |")
    from jaxalign.numerics.platforms import cpu_model_and_flags
    write_json(args.out, {"cpu": cpu_model_and_flags()[0], "model": args.model, "rows": rows})


if __name__ == "__main__":
    main()
