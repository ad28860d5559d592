"""Trainer throughput: a jaxalign forward+backward (jitted value_and_grad of the mean next-token logprob) vs the
same loss through transformers' PyTorch model, same `bench` weights and tokens, fp32.

    python benchmarks/train_step.py [--batch 8] [--seq 80] [--policy P ...] [--hf ATTN:EXPERTS ...] [--repeats 5]

Every side runs in its own process, pinned to the same CPUs with its thread counts printed. Sides: jaxalign
under each `--policy` (default `fp32` and `fp32,dispatch=bucketed`) and transformers with its attention and
experts implementations named (`--hf`, default `eager:eager` and `sdpa:grouped_mm`). The first step
(compilation) is timed apart; then `--repeats` rounds, each timing every side once in rotating order; a side's
figure is its best round. For the breakdown each side also times its forward alone (the same loss, no
gradient; interleaved the same way): `backward_s_est` = best step - best forward. The cost of alignment (bf16 policies) is in benchmarks/alignment_cost.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import (Side, interleaved_best, peak_rss_mib, pin_threads, serve, thread_settings, timed,  # noqa: E402,I001
                    trainer_step_fn, write_json)

GOAL = 2.0  # jaxalign's fastest fp32 step vs transformers' fastest


def jax_side(policy_text: str) -> None:
    """Serve a jitted jaxalign forward+backward under one policy."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jaxalign as ja
    from jaxalign import sequence_logprobs
    from jaxalign.interop import hf
    state = {}

    def load(path, tokens):
        model, policy = hf.load(path), ja.NumericPolicy.parse(policy_text)
        step, params = trainer_step_fn(model, policy)
        graphdef, _ = nnx.split(model)
        forward = jax.jit(lambda p, t: -jnp.mean(sequence_logprobs(nnx.merge(graphdef, p), t, policy)[0]))
        state["run"] = lambda t=jnp.asarray(tokens, jnp.int32): step(params, t)
        state["forward"] = lambda t=jnp.asarray(tokens, jnp.int32): forward(params, t)
        first_s, (loss, _) = timed(state["run"])
        timed(state["forward"])
        return {"threads": thread_settings(), "first_call_s": first_s, "loss": float(loss),
                "peak_rss_mib": peak_rss_mib()}

    serve({"load": load, "time": lambda: timed(state["run"])[0], "time_forward": lambda: timed(state["forward"])[0],
           "final": lambda: {"peak_rss_mib": peak_rss_mib()}})


def hf_side(spec: str) -> None:
    """Serve a transformers forward+backward with `attn:experts` implementations."""
    import torch
    import transformers

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    torch.set_num_interop_threads(1)
    attn, experts = spec.split(":")
    state = {}

    def load(path, tokens):
        peer = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, attn_implementation=attn, experts_implementation=experts)
        ids = torch.tensor(tokens, dtype=torch.long)

        def step():
            peer.zero_grad(set_to_none=True)
            logits = peer(ids).logits
            lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(2, ids[:, 1:, None])
            loss = -lp.mean()
            loss.backward()
            return loss

        def forward():
            with torch.no_grad():
                logits = peer(ids).logits
                return -torch.log_softmax(logits[:, :-1].float(), -1).gather(2, ids[:, 1:, None]).mean()

        state["run"], state["forward"] = step, forward
        first_s, loss = timed(step)
        forward()
        return {"threads": thread_settings(), "first_call_s": first_s, "loss": loss.item(),
                "peak_rss_mib": peak_rss_mib(), "attn_implementation": peer.config._attn_implementation,
                "experts_implementation": peer.config._experts_implementation}

    serve({"load": load, "time": lambda: timed(state["run"])[0], "time_forward": lambda: timed(state["forward"])[0],
           "final": lambda: {"peak_rss_mib": peak_rss_mib()}})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", help=argparse.SUPPRESS)
    parser.add_argument("--model", default="bench")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=80)
    parser.add_argument("--policy", action="append", dest="policies",
                        help="trainer policy, repeatable (default: fp32 and fp32,dispatch=bucketed)")
    parser.add_argument("--hf", action="append", dest="hf_specs",
                        help="transformers attn:experts, repeatable (default eager:eager and sdpa:grouped_mm)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, help="CPUs (and threads) per side; default: all of this process's")
    parser.add_argument("--out", default="benchmarks/results/train_step.json")
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
    policies = args.policies or ["fp32", "fp32,dispatch=bucketed"]
    hf_specs = args.hf_specs or ["eager:eager", "sdpa:grouped_mm"]
    model = ja.Transformer(ja.ModelConfig.preset(args.model), rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(0, model.config.vocab_size, (args.batch, args.seq)).tolist()
    names = [f"jaxalign {p}" for p in policies] + [f"transformers attn={s.split(':')[0]} experts={s.split(':')[1]}"
                                                  for s in hf_specs]
    sides, loaded = {}, {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            hf.save(model, tmp)
            for name, spec in zip(names, [f"jax={p}" for p in policies] + [f"hf={s}" for s in hf_specs]):
                sides[name] = Side(os.path.abspath(__file__), spec, f"--threads={n_threads}")
            for name, side in sides.items():
                loaded[name] = side.call("load", path=tmp, tokens=tokens)
        runners = {name: (lambda s=side: s.call("time")) for name, side in sides.items()}
        runners.update({f"{name} forward": (lambda s=side: s.call("time_forward")) for name, side in sides.items()})
        best = interleaved_best(runners, args.repeats)
        final = {name: side.call("final") for name, side in sides.items()}
    finally:
        for side in sides.values():
            side.close()
    n_tok = args.batch * args.seq
    rows = [{"implementation": name, "step_s": best[name], "tokens_per_s": n_tok / best[name],
             "forward_s": best[f"{name} forward"], "backward_s_est": best[name] - best[f"{name} forward"],
             "first_call_s": loaded[name]["first_call_s"], "loss": loaded[name]["loss"],
             "peak_rss_mib": final[name]["peak_rss_mib"]} for name in names]
    fastest_jax = min(rows[:len(policies)], key=lambda r: r["step_s"])
    fastest_hf = min(rows[len(policies):], key=lambda r: r["step_s"])
    summary = {"fastest_jaxalign": fastest_jax["implementation"], "fastest_transformers": fastest_hf["implementation"],
               "speedup": fastest_hf["step_s"] / fastest_jax["step_s"], "goal": GOAL}
    summary["goal_met"] = summary["speedup"] >= GOAL
    print(f"model {args.model}; fp32 forward+backward on [{args.batch}, {args.seq}] tokens; {n_threads} threads per "
          f"side; best of {args.repeats} interleaved rounds")
    tables = {"train_step": report.table(rows, ["implementation", "step_s", "tokens_per_s", "forward_s",
                                                "backward_s_est", "first_call_s", "peak_rss_mib"])}
    print(tables["train_step"])
    print(f"fastest jaxalign vs fastest transformers: {summary['speedup']:.2f}x (goal >= {GOAL}x)")
    write_json(args.out, {"args": vars(args), "sides": loaded, "rows": rows, "summary": summary,
                          "tables": tables})
    return 0


if __name__ == "__main__":
    sys.exit(main())
