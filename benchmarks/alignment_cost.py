"""What bitwise alignment costs: aligned-bf16 vs serve-bf16 (engine new tokens/s) and vs train-bf16 (trainer
forward+backward step time), measured in one run on the same model and data.

    python benchmarks/alignment_cost.py [--model small] [--batch 8] [--new-tokens 64] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys

import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(__file__))
import jaxalign as ja  # noqa: E402
from common import best_of, trainer_step_seconds, write_json  # noqa: E402
from jaxalign import report  # noqa: E402


def engine_tokens_per_s(model, policy, prompts, new_tokens, batch):
    engine = ja.Engine(model, policy)
    run = lambda: engine.generate(prompts, max_new_tokens=new_tokens, temperature=0.0,  # noqa: E731
                                  batch_size=batch).tokens
    seconds = best_of(run)
    return len(prompts) * new_tokens / seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--train-batch", type=int, default=16)
    parser.add_argument("--train-len", type=int, default=80)
    parser.add_argument("--out", default="benchmarks/results/alignment_cost.json")
    args = parser.parse_args(argv)
    model = ja.Transformer(ja.ModelConfig.preset(args.model), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompts = [rng.integers(0, vocab, args.prompt_len) for _ in range(args.batch)]
    tokens = jnp.asarray(rng.integers(0, vocab, (args.train_batch, args.train_len)), jnp.int32)
    rows = []
    for name in ("serve-bf16", "train-bf16", "aligned-bf16"):
        policy = ja.NumericPolicy.preset(name)
        rows.append({"policy": name,
                     "engine_tokens_per_s": engine_tokens_per_s(model, policy, prompts, args.new_tokens, args.batch),
                     "trainer_step_s": trainer_step_seconds(model, policy, tokens)})
    by = {r["policy"]: r for r in rows}
    aligned = by["aligned-bf16"]
    summary = {"engine_slowdown_vs_serve": by["serve-bf16"]["engine_tokens_per_s"] / aligned["engine_tokens_per_s"],
               "trainer_slowdown_vs_train": aligned["trainer_step_s"] / by["train-bf16"]["trainer_step_s"],
               "target": 1.3}
    print(f"model {args.model}; engine: batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
          f"greedy; trainer: forward+backward on [{args.train_batch}, {args.train_len}]")
    print(report.table(rows, ["policy", "engine_tokens_per_s", "trainer_step_s"]))
    print(f"aligned-bf16 engine slowdown vs serve-bf16: {summary['engine_slowdown_vs_serve']:.2f}x; "
          f"trainer slowdown vs train-bf16: {summary['trainer_slowdown_vs_train']:.2f}x (target <= 1.3x)")
    write_json(args.out, {"args": vars(args), "rows": rows, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
