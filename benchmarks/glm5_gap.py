"""The GLM-5 (tiny-glm5) trainer-engine gap: k3 and DSA index flips for an expanded-MLA trainer against an
absorbed-MLA engine and for train-bf16 against serve-bf16, with and without index replay, R3 (expert ids) and
R3w (expert ids and the engine's combine weights), plus the KV cache bytes of the latent cache against per-head
K/V. Prints docs/families.md's table and writes JSON.

The engine generates (temperature 1) and records its own DSA index selections, experts and combine weights in the
Rollout; the trainer scores the tokens teacher-forced, replaying what the replay mode names
(`jaxalign.align.compare.engine_replay`).

    python benchmarks/glm5_gap.py [--prompts 16] [--new-tokens 24]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from flax import nnx

sys.path.insert(0, os.path.dirname(__file__))
import jaxalign as ja  # noqa: E402
from common import write_json  # noqa: E402
from jaxalign.align.compare import engine_replay, random_prompts  # noqa: E402
from jaxalign.metrics.index import index_flip_metrics  # noqa: E402
from jaxalign.metrics.mismatch import mismatch_metrics  # noqa: E402
from jaxalign.engine import kernels  # noqa: E402
from jaxalign.numerics import dtype  # noqa: E402

PAIRS = [("expanded vs absorbed", "aligned-bf16", "aligned-bf16,mla=absorbed"),
         ("train-bf16 vs serve-bf16", "train-bf16", "serve-bf16")]
REPLAYS = ("none", "index", "r3", "r3+index", "r3w", "r3w+index")


def cache_bytes(cfg, policy, batch: int, cache_len: int) -> dict:
    """Bytes of the engine's actual cache arrays, and of per-head K/V for the same dims."""
    arrays = kernels._empty_kv(cfg, batch, cache_len, policy)
    latent = int(sum(np.asarray(a).nbytes for a in arrays))
    itemsize = np.dtype(dtype(policy.kv_cache_dtype)).itemsize
    per_head = cfg.n_layers * batch * cache_len * cfg.n_heads * (cfg.head_dim + cfg.v_head_dim) * itemsize
    return {"batch": batch, "cache_len": cache_len, "latent_cache_bytes": latent, "per_head_kv_bytes": per_head,
            "ratio": per_head / latent}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "glm5_gap.json"))
    args = parser.parse_args(argv)
    model = ja.Transformer(ja.ModelConfig.preset("tiny-glm5"), rngs=nnx.Rngs(0))
    cfg = model.config
    prompts = random_prompts(cfg.vocab_size, args.prompts, seed=0)
    rows = []
    for name, trainer_name, engine_name in PAIRS:
        trainer, engine = ja.NumericPolicy.parse(trainer_name), ja.NumericPolicy.parse(engine_name)
        rollout = ja.generate(model, prompts, engine, max_new_tokens=args.new_tokens, seed=0)
        engine_rec = rollout.routing  # the engine's own selections, recorded while it generated
        valid = np.zeros(rollout.tokens.shape, bool)
        valid[:, 1:] = rollout.mask  # the positions whose next-token logprob is scored
        for replay in REPLAYS:
            lp, rec = ja.token_logprobs(model, rollout.tokens, trainer, **engine_replay(rollout, replay))
            gap = mismatch_metrics(np.asarray(lp), rollout.logprobs, rollout.mask)
            flips = index_flip_metrics(engine_rec.index_positions, np.asarray(rec.index_positions), valid=valid,
                                       margins_a=engine_rec.index_margins)
            rows.append({"pair": name, "trainer": trainer_name, "engine": engine_name, "replay": replay,
                         "k3_kl": gap["k3_kl"], "max_abs_logp_diff": gap["max_abs_logp_diff"], **flips})
            print(f"{name:26s} replay={replay:9s} k3={gap['k3_kl']:.3e} index flips (trainer's own indexer)="
                  f"{flips['index_flip_rate']:.4f} per layer {[round(x, 4) for x in flips['index_flip_rate_per_layer']]}")
    caches = {p: cache_bytes(cfg, ja.NumericPolicy.preset(p), 8, 64) for p in ("aligned-bf16",)}
    print(f"KV cache, batch 8 x 64 slots (bf16): latent+rope+indexer key {caches['aligned-bf16']['latent_cache_bytes']} B,"
          f" per-head K/V {caches['aligned-bf16']['per_head_kv_bytes']} B ({caches['aligned-bf16']['ratio']:.2f}x)")
    write_json(args.out, {"model": "tiny-glm5", "prompts": args.prompts, "new_tokens": args.new_tokens,
                          "rows": rows, "kv_cache": caches})
    return 0


if __name__ == "__main__":
    sys.exit(main())
