"""What aligned FP8 costs: aligned-fp8 (W8A8 on both sides, bitwise) against serve-fp8 (verl/slime's FP8 engine
beside a bf16 trainer), with aligned-bf16 against serve-bf16 beside it, on the same model and data; with
`--format mxfp4` the same for aligned-mxfp4 against serve-mxfp4 (4-bit experts, benchmarks/results/mxfp4_cost.json).

    python benchmarks/fp8_cost.py [--format fp8|mxfp4] [--model small] [--batch 8] [--repeats 3] [--fp8 ''] [--out FILE]

Engine: greedy decode of `--new-tokens` tokens from `--batch` prompts (tokens/s) under serve-bf16, serve-fp8,
aligned-bf16 and aligned-fp8. Trainer: jitted scoring (token logprobs, forward only) and a forward+backward step
on [train-batch, train-len] under each engine's trainer: train-bf16 (beside serve-bf16 and serve-fp8),
aligned-bf16, aligned-fp8. The claims are ratios: the engine's aligned-fp8 / serve-fp8 and the trainer's
aligned-fp8 / train-bf16 (what making FP8 rollouts exact costs), next to aligned-bf16's (what exactness costs
in bf16) and aligned-fp8 / aligned-bf16. `--fp8` appends overrides to both FP8 presets (e.g.
`wq=e4m3:32x32,aq=e4m3:32`). All policies run in one process, interleaved, best of `--repeats` rounds; the first
call (compilation) is timed apart. On the CPU the FP8 products are emulated (e4m3 values upcast to bf16, one
product per contraction chunk), so FP8 is slower than bf16 here, unlike on FP8 hardware: compare the aligned /
unaligned ratios, not FP8 against bf16.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import interleaved_best, pin_threads, timed, trainer_step_fn, write_json  # noqa: E402,I001

FORMATS = ("fp8", "mxfp4")  # --format: serve-<fmt> against aligned-<fmt> (MXFP4: W4A16 experts, numerics/lowbit.py)


def plan(fmt: str):
    """(engines, trainers, ratios) of a format: (side, numerator, denominator, what it measures) per ratio."""
    serve, aligned, name = f"serve-{fmt}", f"aligned-{fmt}", fmt.upper()
    engines = ["serve-bf16", serve, "aligned-bf16", aligned]
    trainers = ["train-bf16", "aligned-bf16", aligned]
    ratios = [
        ("engine", aligned, serve, f"cost of aligned {name} rollouts (engine)"),
        ("engine", "aligned-bf16", "serve-bf16", "cost of aligned bf16 rollouts (engine)"),
        ("engine", serve, "serve-bf16", f"{name} emulation on this backend (engine)"),
        ("scoring", aligned, "train-bf16", f"cost of an aligned {name} trainer forward"),
        ("scoring", "aligned-bf16", "train-bf16", "cost of an aligned bf16 trainer forward"),
        ("scoring", aligned, "aligned-bf16", f"{name} on top of aligned bf16 (trainer forward)"),
        ("step", aligned, "train-bf16", f"cost of an aligned {name} trainer step"),
        ("step", "aligned-bf16", "train-bf16", "cost of an aligned bf16 trainer step"),
    ]
    return engines, trainers, ratios


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=int, default=8, help="engine batch")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--train-batch", type=int, default=8)
    parser.add_argument("--train-len", type=int, default=48)
    parser.add_argument("--format", choices=FORMATS, default="fp8",
                        help="the quantised pair: serve-FORMAT against aligned-FORMAT (default fp8)")
    parser.add_argument("--fp8", default="", help="overrides appended to the format's two presets, e.g. "
                                                  "wq=e4m3:32x32 (fp8) or wq_scope=all (mxfp4)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, help="CPUs (and threads); default: all of this process's")
    parser.add_argument("--out", help="default benchmarks/results/FORMAT_cost.json")
    args = parser.parse_args(argv)
    args.out = args.out or f"benchmarks/results/{args.format}_cost.json"
    engines, trainers, ratios = plan(args.format)
    n_threads = pin_threads(args.threads)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import jaxalign as ja
    from jaxalign import report

    def policy(name):
        return ja.NumericPolicy.parse(f"{name},{args.fp8}" if args.fp8 and name.endswith(args.format) else name)

    model = ja.Transformer(ja.ModelConfig.preset(args.model), rngs=nnx.Rngs(0))
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    rows = []

    prompts = list(rng.integers(1, vocab, (args.batch, args.prompt_len)).astype(np.int32))
    runs = {}
    for name in engines:
        engine = ja.Engine(model, policy(name))
        runs[name] = (lambda e=engine: e.generate(prompts, max_new_tokens=args.new_tokens, temperature=0.0,
                                                  batch_size=args.batch).tokens)
    firsts = {name: timed(fn)[0] for name, fn in runs.items()}
    best = interleaved_best({name: (lambda fn=fn: timed(fn)[0]) for name, fn in runs.items()}, args.repeats)
    rows += [{"side": "engine", "policy": n, "first_call_s": firsts[n], "best_s": best[n],
              "tokens_per_s": args.batch * args.new_tokens / best[n]} for n in engines]

    tokens = jnp.asarray(rng.integers(0, vocab, (args.train_batch, args.train_len)), jnp.int32)
    graphdef, state = nnx.split(model)
    for side in ("scoring", "step"):
        if side == "scoring":
            fns = {name: (jax.jit(lambda s, t, p=policy(name): ja.sequence_logprobs(nnx.merge(graphdef, s), t, p)[0]),
                          state) for name in trainers}
        else:
            fns = {name: trainer_step_fn(model, policy(name)) for name in trainers}
        firsts = {name: timed(lambda f=f: f[0](f[1], tokens))[0] for name, f in fns.items()}
        best = interleaved_best({name: (lambda f=f: timed(lambda: f[0](f[1], tokens))[0]) for name, f in fns.items()},
                                args.repeats)
        rows += [{"side": side, "policy": n, "first_call_s": firsts[n], "best_s": best[n],
                  "tokens_per_s": tokens.size / best[n]} for n in trainers]

    def seconds(side, name):
        return next(r["best_s"] for r in rows if r["side"] == side and r["policy"] == name)
    summary = [{"side": side, "ratio": f"{a} / {b}", "time_ratio": seconds(side, a) / seconds(side, b), "what": what}
               for side, a, b, what in ratios]
    print(f"model {args.model}; {args.format} presets {policy(engines[1]).compact()} / "
          f"{policy(engines[3]).compact()}; "
          f"engine: batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy; trainer: "
          f"[{args.train_batch}, {args.train_len}]; {n_threads} threads; best of {args.repeats} interleaved rounds")
    tables = {"fp8_cost_rows": report.table(rows, ["side", "policy", "tokens_per_s", "best_s", "first_call_s"]),
              "fp8_cost_summary": report.table(summary, ["side", "ratio", "time_ratio", "what"])}
    print(tables["fp8_cost_rows"])
    print(tables["fp8_cost_summary"])
    write_json(args.out, {"args": vars(args), "rows": rows, "summary": summary, "tables": tables})
    return 0


if __name__ == "__main__":
    sys.exit(main())
