"""Bits fingerprint: sha256 of what every model preset computes under the policies it runs with, so a refactor
that promises "bits unchanged" can prove it.

For each (model preset, policy) pair, at fixed seeds:
- `trainer`: trainer token logprobs [3, 23] and the routing record of the forward pass;
- `gradient`: the gradient of -mean(logprob) with respect to every parameter (one hash per parameter path);
- `static`: the engine, sampled (temperature 1), 4 prompts of lengths 3..10 in static batches of 3 (the last
  batch padded) with prefill in chunks of 4: tokens, logprobs, routing;
- `continuous`: the engine, greedy, the same prompts under continuous batching on 2 slots (slots refill at
  different steps): tokens, logprobs, routing.
And per family preset, `hf_export`: the transformers config.json and tensors `interop.hf` writes.

    python benchmarks/bits_fingerprint.py                       # every pair -> benchmarks/results/bits_fingerprint.json
    python benchmarks/bits_fingerprint.py --check               # recompute every pair, compare with the JSON
    python benchmarks/bits_fingerprint.py --only tiny/aligned-bf16:trainer,continuous --check

Hashes depend on the instruction set XLA:CPU targets, so the JSON keeps one section per `effective_isa()`;
writing merges into the file (other ISAs' sections, and pairs not recomputed, stay).
tests/test_bits_fingerprint.py recomputes a few pairs (`TEST_SUBSET`) and asserts they are equal.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULT = os.path.join(ROOT, "benchmarks", "results", "bits_fingerprint.json")
PARTS = ("trainer", "gradient", "static", "continuous")
BASE_POLICIES = ("fp32", "train-bf16", "serve-bf16", "aligned-bf16")
# what tests/test_bits_fingerprint.py recomputes: GQA on the aligned pair's continuous batching and the trainer,
# MLA + DSA under the absorbed (serve) form in static batches with chunked prefill
TEST_SUBSET = ("tiny/aligned-bf16:trainer,continuous", "tiny-glm5/serve-bf16:static")
PROMPT_LENS = (3, 7, 5, 10)
SIZES_ONLY = ("small", "countdown", "bench")


def _sha(*arrays) -> str:
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(np.asarray(a))
        h.update(str(a.dtype).encode() + str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _record_sha(record) -> str:
    import jax
    return _sha(*[np.asarray(x) for x in jax.tree.leaves(record)])


def build(preset: str):
    """The model of `preset` at seed 0 (a sigmoid router gets a non-zero selection bias, as tests/conftest does)."""
    from flax import nnx

    from jaxalign import ModelConfig, Transformer
    model = Transformer(ModelConfig.preset(preset), rngs=nnx.Rngs(0))
    if model.config.router == "sigmoid_grouped":
        bias = np.random.default_rng(0).normal(0, 0.05, model.config.n_experts).astype(np.float32)
        for block in model.blocks:
            if block.is_moe:
                block.mlp.selection_bias[...] = bias
    return model


def policies_for(preset: str) -> tuple[str, ...]:
    """The policies a preset runs under: the base four, and a family preset's transformers emulation; the
    larger GQA presets of the tiny one's architecture (small, countdown, bench) the trainer's and the aligned."""
    from jaxalign.model.config import ModelConfig
    family = ModelConfig.preset(preset).family
    if preset in SIZES_ONLY:
        return ("train-bf16", "aligned-bf16")
    return BASE_POLICIES + (("hf-emulation",) if family != "jaxalign" else ())


def _policy(preset: str, name: str):
    from jaxalign import NumericPolicy
    from jaxalign.model.config import ModelConfig
    if name == "hf-emulation":
        from jaxalign.interop.hf import emulation_policy
        return emulation_policy(ModelConfig.preset(preset).family)
    return NumericPolicy.preset(name)


def fingerprint(preset: str, policy_name: str, parts=PARTS) -> dict[str, object]:
    """part -> hash (the gradient: parameter path -> hash) for one (preset, policy) pair."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxalign import Engine, sequence_logprobs, token_logprobs
    model, policy = build(preset), _policy(preset, policy_name)
    cfg = model.config
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, (3, 24)).astype(np.int32)
    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, cfg.vocab_size, n).astype(np.int32) for n in PROMPT_LENS]
    out: dict[str, object] = {}
    if "trainer" in parts:
        lp, record = token_logprobs(model, tokens, policy)
        out["trainer"] = _sha(lp, _record_sha(record).encode())
    if "gradient" in parts:
        graphdef, params = nnx.split(model, nnx.Param)

        def loss(p):
            lp, _ = sequence_logprobs(nnx.merge(graphdef, p), jnp.asarray(tokens), policy)
            return -jnp.mean(lp)

        grads = nnx.to_pure_dict(jax.jit(jax.grad(loss))(params))
        flat = jax.tree_util.tree_flatten_with_path(grads)[0]
        out["gradient"] = {jax.tree_util.keystr(path): _sha(leaf) for path, leaf in flat}
    if "static" in parts or "continuous" in parts:
        engine = Engine(model, policy)
        if "static" in parts:
            r = engine.generate(prompts, max_new_tokens=6, temperature=1.0, seed=3, batch_size=3, prefill_chunk=4)
            out["static"] = _sha(r.tokens, r.logprobs, r.mask, _record_sha(r.routing).encode())
        if "continuous" in parts:
            r = engine.generate(prompts, max_new_tokens=6, temperature=0.0, batch_size=2, schedule="continuous")
            out["continuous"] = _sha(r.tokens, r.logprobs, r.mask, _record_sha(r.routing).encode())
    return out


def release_compiled_programs() -> None:
    """Clear JAX's compile caches once this process holds over half the kernel's limit on memory mappings (as
    tests/conftest.py does between tests): XLA:CPU keeps ~3 mappings per JITted kernel while its executable is
    cached, and all the pairs in one process passed vm.max_map_count (65530) once GLM-5's emulation pair compiled
    its indexer's torch-cpu selection (`index_ties`: ~1700 more mappings); the next JIT mmap failed and the
    process died (SIGSEGV) three pairs later.
    A pair never reuses another's programs, so clearing costs nothing and changes no bits."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps") as f:
            count = sum(1 for _ in f)
    except (OSError, ValueError):  # not Linux
        return
    if count > limit // 2:
        import jax
        jax.clear_caches()


def hf_export(preset: str) -> str:
    """Hash of the config.json dict and the tensors `interop.hf` writes for a family preset's model."""
    from jaxalign.interop import hf
    model = build(preset)
    tensors = hf.tensors_to_hf(model)
    config = json.dumps(hf.config_to_hf(model.config), sort_keys=True).encode()
    return _sha(np.frombuffer(config, np.uint8), *[np.frombuffer(k.encode(), np.uint8) for k in sorted(tensors)],
                *[tensors[k] for k in sorted(tensors)])


def all_pairs() -> list[str]:
    """Every `preset/policy:parts` this script computes by default."""
    from jaxalign.model.config import preset_names
    return [f"{m}/{p}:{','.join(PARTS)}" for m in preset_names() for p in policies_for(m)]


def parse_pair(text: str) -> tuple[str, str, tuple[str, ...]]:
    """`preset/policy[:part,part]` -> (preset, policy, parts)."""
    pair, _, parts = text.partition(":")
    preset, _, policy = pair.partition("/")
    parts_t = tuple(parts.split(",")) if parts else PARTS
    if not preset or not policy or any(p not in PARTS for p in parts_t):
        raise ValueError(f"{text!r}: allowed: PRESET/POLICY[:PART,...] with parts from {', '.join(PARTS)}")
    return preset, policy, parts_t


def load(path: str = RESULT) -> dict:
    """The JSON at `path` ({} when absent)."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="pairs PRESET/POLICY[:PART,...] (default: all)")
    parser.add_argument("--check", action="store_true", help="compare with the JSON instead of writing it")
    parser.add_argument("--out", default=RESULT, help=f"the JSON file (default {os.path.relpath(RESULT, ROOT)})")
    args = parser.parse_args(argv)
    sys.path.insert(0, ROOT)
    from jaxalign.model.config import ModelConfig, preset_names
    from jaxalign.numerics.platforms import effective_isa
    isa = effective_isa()
    pairs = [parse_pair(p) for p in (args.only or all_pairs())]
    data = load(args.out)
    section = data.setdefault(isa, {"pairs": {}, "hf_export": {}})
    got: dict[str, dict] = {}
    mismatches, start = [], time.perf_counter()
    for preset, policy, parts in pairs:
        t0 = time.perf_counter()
        result = fingerprint(preset, policy, parts)
        key = f"{preset}/{policy}"
        got.setdefault(key, {}).update(result)
        want = section["pairs"].get(key, {})
        for part, value in result.items():
            if args.check and want.get(part) != value:
                mismatches.append(f"{key}:{part}")
        print(f"{key}: {','.join(parts)} {time.perf_counter() - t0:.1f} s"
              + (f"  MISMATCH" if any(m.startswith(key + ":") for m in mismatches) else ""), flush=True)
        release_compiled_programs()
    exports = {}
    if not args.only:
        for preset in preset_names():
            if ModelConfig.preset(preset).family != "jaxalign":
                exports[preset] = hf_export(preset)
                if args.check and section["hf_export"].get(preset) != exports[preset]:
                    mismatches.append(f"{preset}:hf_export")
    print(f"{len(pairs)} pairs in {time.perf_counter() - start:.0f} s on {isa}")
    if args.check:
        print("all equal" if not mismatches else f"MISMATCH: {mismatches}")
        return 1 if mismatches else 0
    for key, result in got.items():
        section["pairs"].setdefault(key, {}).update(result)
    section["hf_export"].update(exports)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
