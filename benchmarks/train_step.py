"""Trainer throughput: jaxalign forward+backward (jitted value_and_grad of the mean next-token logprob) vs a
transformers PyTorch forward+backward on the same `bench` config and weights, in one run. Prints a table and
writes JSON.

    python benchmarks/train_step.py [--batch 8] [--seq 80] [--policy P ...]

Default policies: fp32, fp32,dispatch=bucketed, train-bf16, aligned-bf16.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import jax.numpy as jnp
import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(__file__))
import jaxalign as ja  # noqa: E402
from common import trainer_step_seconds, write_json  # noqa: E402
from jaxalign import report  # noqa: E402
from jaxalign.interop import hf  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=80)
    parser.add_argument("--policy", action="append", dest="policies",
                        help="trainer policy, repeatable (default: fp32, fp32,dispatch=bucketed, train-bf16, "
                             "aligned-bf16)")
    parser.add_argument("--out", default="benchmarks/results/train_step.json")
    args = parser.parse_args(argv)
    import torch
    import transformers

    model = ja.Transformer(ja.ModelConfig.preset(args.model), rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (args.batch, args.seq))
    rows = []
    for name in args.policies or ["fp32", "fp32,dispatch=bucketed", "train-bf16", "aligned-bf16"]:
        seconds = trainer_step_seconds(model, ja.NumericPolicy.parse(name), jnp.asarray(tokens))
        rows.append({"implementation": f"jaxalign {name}", "step_s": seconds,
                     "tokens_per_s": tokens.size / seconds})
    with tempfile.TemporaryDirectory() as tmp:
        hf.save(model, tmp)
        peer = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    torch.set_num_threads(os.cpu_count())
    ids = torch.tensor(tokens, dtype=torch.long)

    def torch_step():
        peer.zero_grad(set_to_none=True)
        logits = peer(ids).logits
        lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(2, ids[:, 1:, None])
        (-lp.mean()).backward()

    torch_step()
    times = []
    for _ in range(3):
        start = time.perf_counter()
        torch_step()
        times.append(time.perf_counter() - start)
    rows.append({"implementation": "transformers fp32 (eager)", "step_s": min(times),
                 "tokens_per_s": tokens.size / min(times)})
    print(f"model {args.model}; forward+backward on [{args.batch}, {args.seq}] tokens")
    print(report.table(rows, ["implementation", "step_s", "tokens_per_s"]))
    write_json(args.out, {"args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
