"""Decode throughput: jaxalign's engine vs transformers' `generate`, same `bench` weights, same prompts, greedy.

    python benchmarks/decode.py [--batches 1,8,64,256] [--new-tokens 64] [--repeats 5] [--out FILE]

Every side runs in its own process (its peak memory is its own), pinned to the same CPUs with its thread
counts printed. Sides: the jaxalign engine under each `--policy` (default `fp32,dispatch=bucketed` and
`fp32`) and transformers in fp32 with attention/experts implementations named explicitly (`--hf`, default
`eager:eager` and `sdpa:grouped_mm`, transformers' defaults and its fastest on CPU). Prompt ids are drawn from
1..vocab-1, transformers gets an explicit all-ones `attention_mask` and `pad_token_id=0`, so no prompt token can
be taken for padding. The first call (compilation) is timed apart; then `--repeats` rounds, each timing every
side once in rotating order; a side's figure is its best round. KV-cache bytes are measured on each side: the
arrays the jaxalign engine allocates (its own allocation function, evaluated for shape) and the tensors of the
cache transformers returns (keys and values; a linear-attention layer's conv and recurrent states). `--model
tiny-qwen3.5` measures the gated DeltaNet hybrid (`run_all.py`'s `decode_qwen35`).

Greedy agreement: where a jaxalign sequence and a transformers sequence first differ, the fp32 logit gap
between the two tokens chosen is read from a teacher-forced jaxalign forward; gaps at the level of fp32
rounding (<< the median top-1/top-2 gap) mean a near-tie broken differently, after which the sequences diverge.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import Side, interleaved_best, peak_rss_mib, pin_threads, serve, thread_settings, timed, write_json  # noqa: E402,I001

PAD_ID = 0  # prompts are drawn from 1..vocab-1
GOAL, GOAL_BATCHES = 5.0, (1, 8, 64)  # fastest engine >= 5x transformers' fastest at these batches


# --- sides -----------------------------------------------------------------------------------------------------
def jax_side(policy_text: str) -> None:
    """Serve the jaxalign engine under one policy."""
    import jax
    import numpy as np

    import jaxalign as ja
    from jaxalign.engine import kernels
    from jaxalign.interop import hf
    from jaxalign.numerics import dtype
    state = {}

    def load(path):
        state["engine"] = ja.Engine(hf.load(path), ja.NumericPolicy.parse(policy_text))
        return {"threads": thread_settings(), "policy": str(state["engine"].policy)}

    def run():
        return state["engine"].generate(state["prompts"], max_new_tokens=state["new"], temperature=0.0,
                                        batch_size=len(state["prompts"]))

    def setup(prompts, new_tokens):
        state["prompts"], state["new"] = list(np.asarray(prompts, np.int32)), new_tokens
        first_s, out = timed(run)
        engine = state["engine"]
        cache = jax.eval_shape(lambda: kernels._empty_kv(engine.config, len(prompts), out.stats["cache_len"],
                                                         engine.policy))
        kv_bytes = sum(x.size * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(cache))
        assert kv_bytes == engine.kv_cache_bytes(len(prompts), out.stats["cache_len"])
        if any(kind != "gated_deltanet" for kind in engine.config.layer_kinds):  # a KV cache is there
            assert str(np.dtype(dtype(engine.policy.kv_cache_dtype))) in {str(x.dtype) for x in jax.tree.leaves(cache)}
        return {"first_call_s": first_s, "tokens": out.tokens.tolist(), "kv_cache_bytes": kv_bytes,
                "cache_slots": out.stats["cache_len"], "peak_rss_mib": peak_rss_mib()}

    def time_once():
        return timed(lambda: run().tokens)[0]

    serve({"load": load, "setup": setup, "time": time_once,
           "final": lambda: {"peak_rss_mib": peak_rss_mib(), "threads": thread_settings()}})


def hf_side(spec: str) -> None:
    """Serve transformers' generate with `attn:experts` implementations."""
    import torch
    import transformers

    n = len(os.sched_getaffinity(0))
    torch.set_num_threads(n)
    torch.set_num_interop_threads(1)
    attn, experts = spec.split(":")
    state = {}

    def load(path):
        peer = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation=attn, experts_implementation=experts).eval()
        state["peer"] = peer
        return {"threads": thread_settings(), "attn_implementation": peer.config._attn_implementation,
                "experts_implementation": peer.config._experts_implementation}

    def run():
        with torch.no_grad():
            return state["peer"].generate(
                input_ids=state["ids"], attention_mask=torch.ones_like(state["ids"]), max_new_tokens=state["new"],
                min_new_tokens=state["new"], do_sample=False, eos_token_id=None, pad_token_id=PAD_ID,
                use_cache=True, return_dict_in_generate=True)

    def setup(prompts, new_tokens):
        state["ids"], state["new"] = torch.tensor(prompts, dtype=torch.long), new_tokens
        first_s, out = timed(run)
        cache = out.cache  # keys/values per attention layer; conv and recurrent states per linear-attention one
        kv_bytes = sum(_tensor_bytes(vars(layer)) for layer in cache.layers)
        slots = [layer.keys.shape[-2] for layer in cache.layers
                 if isinstance(getattr(layer, "keys", None), torch.Tensor)]
        return {"first_call_s": first_s, "tokens": out.sequences.tolist(), "kv_cache_bytes": kv_bytes,
                "cache_slots": int(slots[0]) if slots else 0, "peak_rss_mib": peak_rss_mib()}

    def time_once():
        return timed(run)[0]

    serve({"load": load, "setup": setup, "time": time_once,
           "final": lambda: {"peak_rss_mib": peak_rss_mib(), "threads": thread_settings()}})


def _tensor_bytes(value) -> int:
    """Bytes of every torch tensor in `value` (a tensor, or dicts, lists and tuples of them)."""
    import torch
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


# --- parent ----------------------------------------------------------------------------------------------------
def divergence(model, ours, theirs, prompt_len):
    """Greedy agreement of two [B, S] token arrays and, at each sequence's first difference, jaxalign's fp32 logit
    gap between the two tokens chosen (teacher-forced on `ours`), next to the median top-1/top-2 gap."""
    import jax.numpy as jnp
    import numpy as np

    import jaxalign as ja
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    new_ours, new_theirs = ours[:, prompt_len:], theirs[:, prompt_len:]
    differs = new_ours != new_theirs
    out = {"token_agreement": float(np.mean(~differs)), "sequences_equal": float(np.mean(~differs.any(1)))}
    logits, _ = model(jnp.asarray(ours), policy=ja.NumericPolicy.preset("fp32"))
    logits = np.asarray(logits, np.float64)[:, prompt_len - 1:-1]  # row t predicts new token t
    top2 = np.sort(logits, -1)[..., -2:]
    out["median_top2_gap"] = float(np.median(top2[..., 1] - top2[..., 0]))
    gaps = []
    for b in np.nonzero(differs.any(1))[0]:
        t = int(np.argmax(differs[b]))
        gaps.append(float(logits[b, t, new_ours[b, t]] - logits[b, t, new_theirs[b, t]]))
    out["first_divergence_gaps"] = gaps
    out["max_first_divergence_gap"] = max(gaps) if gaps else None
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="bench")
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--policy", action="append", dest="policies",
                        help="engine policy, repeatable (default: fp32,dispatch=bucketed and fp32)")
    parser.add_argument("--hf", action="append", dest="hf_specs",
                        help="transformers attn:experts implementations, repeatable (default eager:eager and "
                             "sdpa:grouped_mm)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, help="CPUs (and threads) per side; default: all of this process's")
    parser.add_argument("--out", default="benchmarks/results/decode.json")
    args = parser.parse_args(argv)
    n_threads = pin_threads(args.threads)
    if args.side:
        kind, _, spec = args.side.partition("=")
        (jax_side if kind == "jax" else hf_side)(spec)
        return 0

    import numpy as np
    from flax import nnx

    import jaxalign as ja
    from jaxalign import report
    from jaxalign.interop import hf
    policies = args.policies or ["fp32,dispatch=bucketed", "fp32"]
    hf_specs = args.hf_specs or ["eager:eager", "sdpa:grouped_mm"]
    model = ja.Transformer(ja.ModelConfig.preset(args.model), rngs=nnx.Rngs(0))
    cfg = model.config
    names = [f"jaxalign {p}" for p in policies] + [f"transformers attn={s.split(':')[0]} experts={s.split(':')[1]}"
                                                  for s in hf_specs]
    sides, loaded = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        hf.save(model, tmp)  # the same weights, as a transformers checkpoint; every side loads them from here
        for name, spec in zip(names, [f"jax={p}" for p in policies] + [f"hf={s}" for s in hf_specs]):
            sides[name] = Side(os.path.abspath(__file__), spec, f"--threads={n_threads}")
        for name, side in sides.items():
            loaded[name] = side.call("load", path=tmp)
    rows, pairs = [], []
    rng = np.random.default_rng(0)
    try:
        for batch in [int(b) for b in args.batches.split(",")]:
            prompts = rng.integers(1, cfg.vocab_size, (batch, args.prompt_len)).astype(np.int32)
            assert not (prompts == PAD_ID).any()
            first = {name: side.call("setup", prompts=prompts.tolist(), new_tokens=args.new_tokens)
                     for name, side in sides.items()}
            best = interleaved_best({name: (lambda s=side: s.call("time")) for name, side in sides.items()},
                                    args.repeats)
            new = batch * args.new_tokens
            for name in names:
                rows.append({"side": name, "batch": batch, "tokens_per_s": new / best[name],
                             "best_s": best[name], "first_call_s": first[name]["first_call_s"],
                             "kv_cache_bytes": first[name]["kv_cache_bytes"],
                             "cache_slots": first[name]["cache_slots"],
                             "peak_rss_mib": first[name]["peak_rss_mib"]})
                print(report.table(rows[-1:], list(rows[-1])), flush=True)
            for ours in names[:len(policies)]:
                for theirs in names[len(policies):]:
                    agree = divergence(model, first[ours]["tokens"], first[theirs]["tokens"], args.prompt_len)
                    pairs.append({"jaxalign": ours, "transformers": theirs, "batch": batch,
                                  "speedup": best[theirs] / best[ours], **agree})
        final = {name: side.call("final") for name, side in sides.items()}
    finally:
        for side in sides.values():
            side.close()
    for name in names:
        loaded[name]["final_peak_rss_mib"] = final[name]["peak_rss_mib"]
    print(f"model {args.model} (d_model {cfg.d_model}, {cfg.n_layers} layers, {cfg.n_experts} experts top-{cfg.top_k}, "
          f"vocab {cfg.vocab_size}); greedy, prompt {args.prompt_len}, {args.new_tokens} new tokens; fp32; "
          f"{n_threads} threads per side; best of {args.repeats} interleaved rounds")
    side_cols = ["side", "batch", "tokens_per_s", "first_call_s", "kv_cache_bytes", "peak_rss_mib"]
    pair_cols = ["jaxalign", "transformers", "batch", "speedup", "token_agreement", "sequences_equal",
                 "max_first_divergence_gap", "median_top2_gap"]
    summary = []
    for batch in sorted({r["batch"] for r in rows}):
        ours = min((r for r in rows if r["batch"] == batch and r["side"] in names[:len(policies)]),
                   key=lambda r: r["best_s"])
        theirs = min((r for r in rows if r["batch"] == batch and r["side"] in names[len(policies):]),
                     key=lambda r: r["best_s"])
        entry = {"batch": batch, "fastest_jaxalign": ours["side"], "fastest_transformers": theirs["side"],
                 "speedup": theirs["best_s"] / ours["best_s"], "goal": GOAL if batch in GOAL_BATCHES else None}
        entry["goal_met"] = None if entry["goal"] is None else entry["speedup"] >= GOAL
        summary.append(entry)
    tables = {"decode_sides": report.table(rows, side_cols), "decode_speedup": report.table(pairs, pair_cols),
              "decode_summary": report.table(summary, ["batch", "fastest_jaxalign", "fastest_transformers",
                                                       "speedup", "goal", "goal_met"])}
    print(tables["decode_sides"])
    print(tables["decode_speedup"])
    print(tables["decode_summary"])
    write_json(args.out, {"args": vars(args), "sides": loaded, "rows": rows, "pairs": pairs, "summary": summary,
                          "tables": tables})
    return 0


if __name__ == "__main__":
    sys.exit(main())
