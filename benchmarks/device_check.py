"""The device check for a session lent a GPU (or TPU): every step in its own process with its own timeout, every
result as JSON under one folder, the whole run under a time budget.

    python benchmarks/device_check.py [--out DIR] [--budget-s 450] [--quick] [--timeout-scale X] [--only a,b]

Steps (each writes DIR/<step>.json; its exit code, time and output tail go to DIR/summary.json):
1. `environment` -- versions, devices, and an import check of every jaxalign module and of the JAX APIs the
   code uses (the lent machine runs a newer JAX than the pinned 0.10.2: a missing name shows here first);
2. `kernels` -- benchmarks/device_kernels.py: the implementation each batch-invariant kernel ran with (Pallas
   via Triton/Mosaic for tiled:T on a GPU/TPU), bits alone vs in batches, error vs float64;
3. `check_aligned` -- `jaxalign check --trainer aligned-bf16 --engine aligned-bf16 --json`;
4. `check_train_serve` -- `jaxalign check --trainer train-bf16 --engine serve-bf16 --json`;
5. `alignment_cost` -- benchmarks/alignment_cost.py: aligned-bf16 vs the fastest non-aligned bf16 policy, engine
   and trainer, small sizes;
6. `decode` -- benchmarks/decode.py: the engine vs transformers' generate, a small batch list.
A step's non-zero exit (e.g. `check` finding a gap: exit 1) is recorded, not fatal; a step past its timeout is
killed and recorded as such. `jaxalign check` runs with `--xla_gpu_deterministic_ops=true` added to XLA_FLAGS
(docs/accelerators.md). `--quick`: tiny sizes, for proving the script end to end on a CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# names the code takes from JAX (grep of jaxalign/ under 0.10.2), checked on the machine at hand
JAX_APIS = ["jax.clear_caches", "jax.custom_vjp", "jax.custom_jvp", "jax.set_mesh", "jax.make_array_from_callback",
            "jax.core.Tracer", "jax.tree_util.register_dataclass", "jax.tree_util.tree_flatten_with_path",
            "jax.tree_util.tree_map_with_path", "jax.tree_util.keystr", "jax.distributed.initialize",
            "jax.sharding.Mesh", "jax.sharding.get_abstract_mesh", "jax.lax.with_sharding_constraint",
            "jax.lax.AccuracyMode", "jax.lax.DotAlgorithmPreset", "jax.lax.Precision", "jax.lax.ragged_dot",
            "jax.lax.logistic", "jax.lax.reduce_precision", "jax.lax.optimization_barrier", "jax.lax.top_k",
            "jax.random.gumbel", "jax.experimental.multihost_utils", "jax.experimental.pallas.pallas_call",
            "jax.experimental.pallas.BlockSpec", "jax.experimental.pallas.no_block_spec",
            "jax.experimental.pallas.ds", "jax.experimental.pallas.multiple_of",
            "jax.experimental.pallas.next_power_of_2", "jax.experimental.pallas.program_id",
            "jax.experimental.pallas.tpu.SMEM", "jax.experimental.pallas.tpu.InterpretParams",
            "jax._src.xla_bridge.backends_are_initialized"]

ENVIRONMENT = r"""
import importlib, json, pkgutil, sys
out = {"python": sys.version.split()[0]}
import jaxalign  # first: it sets jaxalign's XLA flags before JAX starts a backend
import jax, jaxlib
out.update(jax=jax.__version__, jaxlib=jaxlib.__version__, backend=jax.default_backend(),
           devices=[str(d) for d in jax.devices()], device_kind=jax.devices()[0].device_kind)
for name in ("flax", "optax", "orbax.checkpoint", "torch", "transformers"):
    try:
        out[name] = getattr(importlib.import_module(name), "__version__", "?")
    except Exception as err:
        out[name] = f"not importable: {type(err).__name__}: {err}"
failed = {}
for mod in pkgutil.walk_packages(jaxalign.__path__, "jaxalign."):
    try:
        importlib.import_module(mod.name)
    except Exception as err:
        failed[mod.name] = f"{type(err).__name__}: {err}"
out["jaxalign"] = jaxalign.__file__
out["modules_failed"] = failed
missing = []
for path in json.loads(sys.argv[2]):
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
            break
        except ImportError:
            continue
    try:
        for attr in parts[i:]:
            obj = getattr(obj, attr)
    except AttributeError:
        missing.append(path)
out["jax_apis_missing"] = missing
with open(sys.argv[1], "w") as f:
    json.dump(out, f, indent=2)
print(json.dumps(out, indent=2))
sys.exit(1 if failed or missing else 0)
"""


def steps(out: str, quick: bool) -> list[tuple[str, list[str], int, dict]]:
    """(name, command, timeout_s, extra environment) for each step."""
    py = sys.executable
    model = "tiny"
    check_sizes = (["--engine-batch", "1,2", "--probe-batch", "1,3", "--max-new-tokens", "4"] if quick else
                   ["--engine-batch", "1,8", "--probe-batch", "1,3,8", "--max-new-tokens", "8"])
    cost = (["--model", "tiny", "--batches", "2", "--new-tokens", "4", "--train-batch", "2", "--train-len", "8",
             "--repeats", "1"] if quick else
            ["--model", "small", "--batches", "8", "--new-tokens", "32", "--train-batch", "8", "--train-len", "64",
             "--repeats", "3"])
    decode = (["--model", "tiny", "--batches", "1", "--new-tokens", "4", "--repeats", "1", "--hf", "eager:eager"]
              if quick else ["--model", "small", "--batches", "1,8,64", "--new-tokens", "32", "--repeats", "3",
                             "--policy", "aligned-bf16", "--policy", "serve-fast-bf16", "--policy", "fp32"])
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_deterministic_ops=true").strip()
    check = [py, "-m", "jaxalign.cli", "check", "--model", model, *check_sizes, "--json", "--no-progress"]
    return [
        ("environment", [py, "-c", ENVIRONMENT, os.path.join(out, "environment.json"), json.dumps(JAX_APIS)], 90, {}),
        ("kernels", [py, os.path.join(HERE, "device_kernels.py"), "--out", os.path.join(out, "kernels.json")], 90, {}),
        ("check_aligned", check + ["--trainer", "aligned-bf16", "--engine", "aligned-bf16"], 120,
         {"XLA_FLAGS": flags}),
        ("check_train_serve", check + ["--trainer", "train-bf16", "--engine", "serve-bf16"], 90,
         {"XLA_FLAGS": flags}),
        ("alignment_cost", [py, os.path.join(HERE, "alignment_cost.py"), *cost, "--ablations", "",
                            "--out", os.path.join(out, "alignment_cost.json")], 90, {}),
        ("decode", [py, os.path.join(HERE, "decode.py"), *decode, "--out", os.path.join(out, "decode.json")], 90, {}),
    ]


def run_step(name: str, command: list[str], timeout_s: float, env: dict, out: str) -> dict:
    """Run one step; its stdout is the step's JSON for the `check` steps, else its log."""
    start = time.perf_counter()
    # its own process group, so that a timeout also ends the processes it started (decode.py's sides)
    proc = subprocess.Popen(command, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        code = "timeout"
    seconds = time.perf_counter() - start
    if name.startswith("check_") and code != "timeout":
        with open(os.path.join(out, f"{name}.json"), "w") as f:
            f.write(stdout)
    with open(os.path.join(out, f"{name}.log"), "w") as f:
        f.write(f"$ {' '.join(command[:3])} ...\n--- stdout\n{stdout}\n--- stderr\n{stderr}\n")
    return {"step": name, "exit": code, "seconds": round(seconds, 1), "timeout_s": round(timeout_s),
            "stderr_tail": stderr[-1500:]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(HERE, "results", "device"))
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="the whole run's limit: a step gets min(its timeout, what is left)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a CPU proof that the script works)")
    parser.add_argument("--timeout-scale", type=float, default=1.0,
                        help="multiply every step's timeout (a loaded CPU needs several times the device's)")
    parser.add_argument("--only", help="comma-separated step names")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    deadline = time.perf_counter() + args.budget_s
    chosen = steps(args.out, args.quick)
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {s[0] for s in chosen}
        if unknown:
            parser.error(f"--only {sorted(unknown)}: allowed: {', '.join(s[0] for s in chosen)}")
        chosen = [s for s in chosen if s[0] in wanted]
    summary = []
    for name, command, timeout_s, env in chosen:
        left = deadline - time.perf_counter()
        if left < 10:
            summary.append({"step": name, "exit": "skipped (budget spent)", "seconds": 0, "timeout_s": 0})
            continue
        result = run_step(name, command, min(timeout_s * args.timeout_scale, left), env, args.out)
        summary.append(result)
        print(f"{name}: exit {result['exit']} in {result['seconds']} s", flush=True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump({"quick": args.quick, "budget_s": args.budget_s, "timeout_scale": args.timeout_scale,
                   "steps": summary}, f, indent=2)
    print(f"wrote {os.path.join(args.out, 'summary.json')}")
    return 0 if all(s["exit"] in (0, 1) for s in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
