"""The seed's Qwen3.5-MoE finding on a tiny model: how the MoE block sums its k weighted expert outputs is a
backend choice, and the choice alone opens a trainer-engine gap.

The three paths (`jaxalign.numerics.experts.AGGREGATION_PATHS`, each three policy fields over one base policy):
- `eager`: transformers' eager experts loop -- gate weights cast to bf16, each expert's output weighted in bf16 and
  `index_add_`-ed into a bf16 buffer in expert order (k - 1 roundings per token);
- `grouped`: transformers' `grouped_mm` path -- the same bf16 products summed over the k slots in float32 and cast
  once;
- `f32`: float32 gate weights and float32 products, summed in float32 and cast once (a trainer's f32 combine).

`aggregation_gap` samples tokens once, scores them teacher-forced under each path (so nothing but the sum
differs between two scores: same tokens, same forward form) and reports the gap of every pair for each top-k,
then runs `localize` on eager against grouped: which field it names, and what taking the MoE blocks from the
reference path leaves. At top-2 eager and grouped coincide exactly (bf16(0 + p1) = p1, and p1 + p2 rounds once
either way); from top-3 on they do not.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from flax import nnx

from jaxalign.align.compare import random_prompts
from jaxalign.align.localize import localize
from jaxalign.engine import Engine
from jaxalign.metrics.mismatch import mismatch_metrics
from jaxalign.metrics.routing import routing_metrics
from jaxalign.model.config import ModelConfig
from jaxalign.model.scoring import token_logprobs
from jaxalign.model.transformer import Transformer
from jaxalign.numerics import NumericPolicy
from jaxalign.numerics.experts import AGGREGATION_PATHS, with_aggregation

DEFAULT_PAIRS = (("grouped", "eager"), ("f32", "grouped"), ("f32", "eager"))


def _check(model_config: ModelConfig, top_ks, pairs, reference: str, candidate: str) -> None:
    if model_config.n_experts == 0:
        raise ValueError(f"the {model_config.family!r} config has no routed experts: there is nothing to aggregate")
    bad = [k for k in top_ks if not isinstance(k, int) or not 1 <= k <= model_config.n_experts]
    if bad or not top_ks:
        raise ValueError(f"top_ks = {list(top_ks)}; allowed: ints from 1 to n_experts = {model_config.n_experts}")
    names = {n for pair in pairs for n in pair} | {reference, candidate}
    unknown = sorted(names - set(AGGREGATION_PATHS))
    if unknown or any(a == b for a, b in pairs):
        raise ValueError(f"pairs {list(pairs)}: each of two different paths of {', '.join(AGGREGATION_PATHS)}"
                         f"{'; unknown: ' + ', '.join(unknown) if unknown else ''}")


def aggregation_gap(model_config: ModelConfig, base: NumericPolicy, *, top_ks=(2, 4, 8), pairs=DEFAULT_PAIRS,
                    n_prompts: int = 16, max_new_tokens: int = 24, seed: int = 0, model_seed: int = 0,
                    reference: str = "grouped", candidate: str = "eager", localize_top_ks=None) -> dict:
    """The gap between aggregation paths on `model_config` with its `top_k` set to each of `top_ks` (the same
    parameters otherwise: one init seed). `base`: the policy every path starts from (its combine fields are
    replaced). Per top-k the reference path generates `n_prompts` continuations; each path scores them
    teacher-forced; a row per pair (trainer path, engine path) holds k3, max |dlogp|, the fraction of tokens
    with bitwise-equal logprobs and the router decisions flipped. `localize` (fields and the module swap) then
    runs on `candidate` (engine) against `reference` (trainer) at each of `localize_top_ks` (default: the top-ks
    from 3 on). Returns a JSON-ready dict."""
    pairs = tuple(tuple(p) for p in pairs)
    _check(model_config, top_ks, pairs, reference, candidate)
    policies = {name: with_aggregation(base, name) for name in AGGREGATION_PATHS}
    localize_top_ks = tuple(k for k in top_ks if k >= 3) if localize_top_ks is None else tuple(localize_top_ks)
    rows, localized = [], []
    for k in top_ks:
        model = Transformer(dataclasses.replace(model_config, top_k=k), rngs=nnx.Rngs(model_seed))
        prompts = random_prompts(model.config.vocab_size, n_prompts, seed,
                                 max_len=min(16, model.config.max_seq_len - max_new_tokens))
        rollout = Engine(model, policies[reference]).generate(prompts, max_new_tokens=max_new_tokens, seed=seed)
        scored = {}
        for name in sorted({n for pair in pairs for n in pair}):
            lp, rec = token_logprobs(model, rollout.tokens, policies[name], sampling=rollout.sampling)
            scored[name] = (np.asarray(lp), np.asarray(rec.indices))
        mask = rollout.mask
        for a, b in pairs:
            (lp_a, idx_a), (lp_b, idx_b) = scored[a], scored[b]
            gap = mismatch_metrics(lp_a, lp_b, mask)
            rows.append({"top_k": k, "trainer_path": a, "engine_path": b, "k3_kl": gap["k3_kl"],
                         "max_abs_logp_diff": gap["max_abs_logp_diff"],
                         "bitwise_equal_fraction": gap["bitwise_equal_fraction"],
                         "route_flip_rate": routing_metrics(idx_b, idx_a)["route_flip_rate"],
                         "n_tokens": int(mask.sum())})
        if k in localize_top_ks:
            found = localize(model, policies[reference], policies[candidate], n_prompts=n_prompts,
                             max_new_tokens=max_new_tokens, seed=seed, attribute=("fields", "modules"))
            modules = {m["module"]: m["k3_with_module_from_trainer"] for m in found["modules"]}
            localized.append({"top_k": k, "trainer_path": reference, "engine_path": candidate,
                              "k3_kl": found["baseline"]["k3_kl"], "culprit": found["culprit"],
                              "fields": [{f: r[f] for f in ("field", "trainer", "engine", "k3_alone", "k3_removed")}
                                         for r in found["fields"]],
                              "k3_moe_from_trainer": modules["mlp"], "k3_attn_from_trainer": modules["attn"]})
    return {"model": model_config.family, "config_fingerprint": model_config.fingerprint(), "base": str(base),
            "paths": {name: str(policies[name]) for name in AGGREGATION_PATHS},
            "path_fields": {name: dict(fields) for name, fields in AGGREGATION_PATHS.items()},
            "top_ks": list(top_ks), "prompts": n_prompts, "max_new_tokens": max_new_tokens, "seed": seed,
            "model_seed": model_seed, "rows": rows, "localize": localized}
