"""The trainer against an engine jaxalign did not write (`jaxalign.engines.RolloutEngine`, e.g. vLLM): generate
with the engine at each batch size, score its tokens with the trainer policy, report the gap under verl's names
(`metrics.mismatch.mismatch_metrics`: kl, k3_kl, max_abs_logp_diff, bitwise_equal_fraction, ...). And "which
numerics is my engine?": score the engine's tokens under every jaxalign policy preset, rank them by k3, and find
which single field of the nearest preset, set on the trainer, moves it nearest.

An engine that records no routing (vLLM on the CPU) gives no route-flip figures: `route_flip_rate` is None and
`routing` says why.
"""

from __future__ import annotations

import time

import numpy as np

from jaxalign.align.compare import random_prompts
from jaxalign.engine.rollout import Rollout
from jaxalign.metrics.mismatch import mismatch_metrics
from jaxalign.model.scoring import token_logprobs
from jaxalign.model.transformer import Transformer
from jaxalign.numerics import PRESETS, NumericPolicy
from jaxalign.numerics.precision import check_backend
from jaxalign.numerics.sampling import SamplingParams

GAP_COLUMNS = ("engine_batch", "kl", "k3_kl", "max_abs_logp_diff", "bitwise_equal_fraction", "n_tokens")


def trainer_gap(model: Transformer, rollout: Rollout, trainer: NumericPolicy) -> dict:
    """mismatch_metrics of the trainer's scores of a rollout's tokens (under the rollout's sampling params) against
    the engine's logprobs."""
    logp, _ = token_logprobs(model, rollout.tokens, trainer, sampling=rollout.sampling)
    return mismatch_metrics(np.asarray(logp), rollout.logprobs, rollout.mask)


def engine_prompts(model: Transformer, n_prompts: int, max_new_tokens: int, seed: int) -> list[np.ndarray]:
    """The random prompts `compare` uses, for the same model, count, length budget and seed."""
    return random_prompts(model.config.vocab_size, n_prompts, seed,
                          max_len=min(16, model.config.max_seq_len - max_new_tokens))


def compare_engine(model: Transformer, trainer: NumericPolicy, engine, *, n_prompts: int = 16,
                   max_new_tokens: int = 32, engine_batches=(8,), seed: int = 0,
                   temperature: float = 1.0, rollouts: list | None = None) -> dict:
    """`compare` against an external engine (a `RolloutEngine` holding `model`'s weights): one run per engine
    batch size, each the engine's rollout of the same prompts scored by the trainer. Returns a JSON-ready report
    with the engine's name, version and numerics; `runs[i]` has verl's metric names. `rollouts`: a list the
    engine's Rollouts are appended to (one per batch size), for a caller that scores them further."""
    from jaxalign.engines.base import describe
    check_backend(trainer, label="trainer policy")
    prompts = engine_prompts(model, n_prompts, max_new_tokens, seed)
    sampling = SamplingParams(temperature=temperature)
    runs, found = [], []
    for batch in engine_batches:
        rollout = engine.generate(prompts, max_new_tokens=max_new_tokens, sampling=sampling, seed=seed,
                                  batch_size=batch)
        start = time.perf_counter()
        metrics = trainer_gap(model, rollout, trainer)
        runs.append({"engine_batch": batch, **metrics, "route_flip_rate": None,
                     "engine_seconds": rollout.stats["seconds"], "trainer_seconds": time.perf_counter() - start})
        found.append(rollout)
    if rollouts is not None:
        rollouts.extend(found)
    same_tokens = all(np.array_equal(r.tokens, found[0].tokens) for r in found[1:])
    same_bits = same_tokens and all(np.array_equal(r.logprobs, found[0].logprobs) for r in found[1:])
    return {"model": model.config.family, "config_fingerprint": model.config.fingerprint(),
            "trainer": str(trainer), "engine": describe(engine), "prompts": n_prompts,
            "max_new_tokens": max_new_tokens, "seed": seed, "temperature": temperature,
            "routing": found[0].stats.get("routing", "recorded"),
            "across_batches": {"same_tokens": bool(same_tokens), "same_logprob_bits": bool(same_bits)},
            "runs": runs}


def runnable_presets() -> list[str]:
    """The policy presets this backend runs (`check_backend` refuses the others, e.g. TF32 on the CPU)."""
    names = []
    for name, policy in PRESETS.items():
        try:
            check_backend(policy, label=name)
        except ValueError:
            continue
        names.append(name)
    return names


def rank_policies(model: Transformer, rollout: Rollout, trainer: NumericPolicy,
                  presets: list[str] | None = None) -> dict:
    """Which jaxalign numerics is this engine's? The rollout's tokens scored under each preset (default: every
    preset this backend runs), ranked by k3 against the engine's logprobs; then each field in which the nearest
    preset differs from `trainer`, set alone on the trainer policy, ranked the same way. `remaining` is the
    nearest preset's k3: what no preset explains."""
    rows = []
    for name in presets or runnable_presets():
        m = trainer_gap(model, rollout, NumericPolicy.preset(name))
        rows.append({"policy": name, **{k: m[k] for k in ("k3_kl", "kl", "max_abs_logp_diff",
                                                          "bitwise_equal_fraction")}})
    rows.sort(key=lambda r: r["k3_kl"])
    nearest = NumericPolicy.preset(rows[0]["policy"])
    base = trainer_gap(model, rollout, trainer)["k3_kl"]
    fields = []
    for field, trainer_value, nearest_value in trainer.diff(nearest):
        try:
            policy = trainer.replace(**{field: getattr(nearest, field)})
            check_backend(policy, label=field)
        except ValueError as err:  # a field that cannot be set alone (an impossible combination)
            fields.append({"field": field, "trainer": trainer_value, "nearest": nearest_value, "k3_kl": None,
                           "note": str(err)})
            continue
        m = trainer_gap(model, rollout, policy)
        fields.append({"field": field, "trainer": trainer_value, "nearest": nearest_value, "k3_kl": m["k3_kl"],
                       "k3_kl_change": m["k3_kl"] - base})
    fields.sort(key=lambda r: np.inf if r["k3_kl"] is None else r["k3_kl"])
    return {"trainer": str(trainer), "trainer_k3_kl": base, "nearest": rows[0]["policy"],
            "remaining_k3_kl": rows[0]["k3_kl"], "presets": rows, "single_fields": fields}
