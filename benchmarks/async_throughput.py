"""RL steps per second, synchronous against asynchronous rollouts (`RLConfig.max_lag` 1 and 2), in one process.

    python benchmarks/async_throughput.py [--variants 0,1,2,1:10,2:10] [--steps 4] [--repeats 3] [--prompts 8]
                                          [--new-tokens 24]

A variant is a lag `K` or `K:N`, lag K measuring the numerics/staleness split on every N-th batch
(`RLConfig.split_every`; plain K measures it on every batch, which at lag > 0 costs one more trainer pass, at the
older weights, on the rollout worker). One `Trainer` per variant on the `countdown` model (random init:
throughput only), aligned-bf16 on both sides. Each trainer's first step (compilation) is untimed. Then `--repeats` rounds, each running a block of `--steps` GRPO
steps on every trainer in rotating order; a block's time includes waiting for the batches its worker queued
ahead, so no trainer is credited with generation done while another was timed. A lag's figure is its best
block, compared with the synchronous variant (the first, lag 0). Writes benchmarks/results/async_throughput.json.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import interleaved_best, write_json  # noqa: E402,I001


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default="0,1,2,1:10,2:10",
                        help="lags K or K:N (lag K, the split measured on every N-th batch); the first is the baseline")
    parser.add_argument("--steps", type=int, default=4, help="GRPO steps per timed block")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (x group size 4)")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "async_throughput.json"))
    args = parser.parse_args(argv)
    from flax import nnx

    import jaxalign as ja
    from jaxalign.rl.trainer import RLConfig, Trainer

    variants = {}
    for text in args.variants.split(","):
        lag, _, every = text.partition(":")
        variants[text] = (int(lag), int(every or 1))
    model = ja.Transformer(ja.ModelConfig.preset("countdown"), rngs=nnx.Rngs(0))
    work = tempfile.mkdtemp(prefix="async_throughput_")
    trainers = {}
    for name, (lag, every) in variants.items():
        cfg = RLConfig(steps=10_000, prompts_per_step=args.prompts, max_new_tokens=args.new_tokens, max_lag=lag,
                       split_every=every, eval_every=10_000, checkpoint_every=10_000)
        trainers[name] = Trainer(model, cfg, os.path.join(work, name.replace(":", "_")))
        trainers[name].train_step()  # compiles every program this variant runs

    def block(trainer):
        def run() -> float:
            start = time.perf_counter()
            for _ in range(args.steps):
                trainer.train_step()
            for future in trainer._pending.values():  # generation queued ahead is part of this block
                future.result()
            return time.perf_counter() - start
        return run

    best = interleaved_best({name: block(t) for name, t in trainers.items()}, args.repeats)
    first = next(iter(variants))
    rows = [{"variant": name, "max_lag": lag, "split_every": every, "best_block_s": best[name],
             "steps_per_s": args.steps / best[name],
             "speedup_vs_sync": best[first] / best[name] if variants[first][0] == 0 else None}
            for name, (lag, every) in variants.items()]
    print(f"{'max_lag':>8} {'split every':>12} {'steps/s':>9} {'vs sync':>8}")
    for r in rows:
        speed = "" if r["speedup_vs_sync"] is None else f"{r['speedup_vs_sync']:.2f}x"
        print(f"{r['max_lag']:>8} {r['split_every']:>12} {r['steps_per_s']:>9.3f} {speed:>8}")
    return write_json(args.out, {"settings": {"model": "countdown", "policies": "aligned-bf16/aligned-bf16",
                                              "prompts_per_step": args.prompts, "group_size": 4,
                                              "max_new_tokens": args.new_tokens, "steps_per_block": args.steps,
                                              "repeats": args.repeats, "variants": args.variants},
                                 "results": rows})


if __name__ == "__main__":
    main()
