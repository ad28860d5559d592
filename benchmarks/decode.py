"""Decode throughput: jaxalign.generate vs transformers' generate on the same `bench` config and weights
(fp32, greedy, prompt 16, 64 new tokens), batch 8 and 64. Prints a table and writes JSON.

    python benchmarks/decode.py [--batches 8,64] [--new-tokens 64] [--policy P ...] [--repeats 5] [--out FILE]

Each `--policy` (default: `fp32,dispatch=bucketed`, then `fp32`) is one engine row per batch against the same
transformers timing. Both sides report their best of `--repeats` timed runs after a warm-up.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile

import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(__file__))
import jaxalign as ja  # noqa: E402
from common import best_of, write_json  # noqa: E402
from jaxalign import report  # noqa: E402
from jaxalign.interop import hf  # noqa: E402


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (MiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench")
    parser.add_argument("--batches", default="8,64")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--policy", action="append", dest="policies",
                        help="engine policy, repeatable (default: fp32,dispatch=bucketed and fp32)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="benchmarks/results/decode.json")
    args = parser.parse_args(argv)
    import torch
    import transformers

    policies = args.policies or ["fp32,dispatch=bucketed", "fp32"]
    model = ja.Transformer(ja.ModelConfig.preset(args.model), rngs=nnx.Rngs(0))
    cfg = model.config
    engines = {name: ja.Engine(model, ja.NumericPolicy.parse(name)) for name in policies}
    with tempfile.TemporaryDirectory() as tmp:
        hf.save(model, tmp)  # the same weights, as a transformers checkpoint
        peer = transformers.AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()
    torch.set_num_threads(os.cpu_count())
    rows = []
    rng = np.random.default_rng(0)
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = rng.integers(0, cfg.vocab_size, (batch, args.prompt_len)).astype(np.int32)
        ids = torch.tensor(prompts, dtype=torch.long)

        def hf_run():
            with torch.no_grad():
                return peer.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)

        hf_s = best_of(hf_run, args.repeats)
        hf_out = hf_run().numpy()
        for name, engine in engines.items():
            run = lambda: engine.generate(list(prompts), max_new_tokens=args.new_tokens,  # noqa: E731
                                          temperature=0.0, batch_size=batch)
            jax_s = best_of(lambda: run().tokens, args.repeats)
            ours = run()
            agree = float(np.mean(hf_out[:, args.prompt_len:] == ours.tokens[:, args.prompt_len:]))
            new = batch * args.new_tokens
            rows.append({"policy": name, "batch": batch, "jaxalign_tokens_per_s": new / jax_s,
                         "transformers_tokens_per_s": new / hf_s, "speedup": hf_s / jax_s,
                         "greedy_token_agreement": agree, "jaxalign_kv_cache_bytes": ours.stats["kv_cache_bytes"],
                         "transformers_kv_cache_bytes": 2 * cfg.n_layers * batch
                         * (args.prompt_len + args.new_tokens) * cfg.n_kv_heads * cfg.head_dim * 4,
                         "peak_rss_mib": peak_rss_mib()})
    print(f"model {args.model} (d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_experts} experts top-{cfg.top_k}, "
          f"vocab {cfg.vocab_size}); greedy, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens; transformers fp32 eager")
    print(report.table(rows, ["policy", "batch", "jaxalign_tokens_per_s", "transformers_tokens_per_s", "speedup",
                              "greedy_token_agreement", "jaxalign_kv_cache_bytes", "transformers_kv_cache_bytes",
                              "peak_rss_mib"]))
    write_json(args.out, {"args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
