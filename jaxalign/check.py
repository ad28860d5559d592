"""The library of `jaxalign check` (the command itself: `jaxalign.cli.check`): validate a model and a trainer/engine
policy pair on the current backend.

Three parts, each against a threshold, one pass/fail verdict:
1. precision audit: every matrix product of the trainer's programs (forward, gradient) and of the engine's
   (static batch, chunked prefill, continuous batching) states its precision (`jaxalign.align.audit`);
2. per-kernel batch-invariance probes (matmul, RMSNorm, softmax, attention): one row computed alone and inside
   batches of 1..32 at the first, middle and last position; a policy that claims batch invariance (a fixed-tile
   kernel and tree reductions) must give the row's bits every time;
3. trainer-vs-engine gap (`jaxalign.align.compare`): KL, k3, max |dlogp| and route flips at each engine batch,
   under continuous batching and with chunked prefill. A pair that claims alignment (one batch-invariant policy
   on both sides) must be bitwise equal; any other pair must stay at k3 <= 1e-3 (the seed's "equivalent") and
   flip no router decision (`max_route_flips`, default 0): a flipped expert means the trainer's gradient goes
   through experts the engine never used (R3 measured ~10% flips on Qwen3-30B-A3B, and MoE GRPO runs that
   collapsed). Router replay (`replay="r3"`) is how a non-aligned pair passes that part.
Beside them, reported without a threshold: each probed kernel's trainer-engine gap on the same rows (a chunked
delta rule against a recurrent one, chunked attention against full). The report also names the implementation
each kernel ran with on this backend (`numerics.kernels`: lax tiled on the CPU, the Pallas kernels for `tiled:T`
on a GPU/TPU), as recorded while the programs were traced.
"""

from __future__ import annotations

import os
from typing import Callable

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jaxalign.align.audit import PROGRAMS, audit, lower_programs
from jaxalign.loading import load_model  # noqa: F401  (moved to jaxalign.loading; importable here as before)
from jaxalign.model import kinds
from jaxalign.model.kinds.base import random_rows
from jaxalign.model.routing import index_layers
from jaxalign.model.transformer import Transformer
from jaxalign.numerics import NumericPolicy, fp8, kernels as kernel_choice, lowbit
from jaxalign.numerics.matmul import matmul
from jaxalign.numerics.platforms import effective_isa
from jaxalign.numerics.precision import check_backend
from jaxalign.numerics.reduce import rms_norm, softmax

CHECK_MODEL = "tiny"  # what `jaxalign check` validates by default: a tiny model, the aligned pair
CHECK_PAIR = {"trainer": "aligned-bf16", "engine": "aligned-bf16"}
THRESHOLD_K3 = 1e-3
THRESHOLD_ROUTE_FLIPS = 0.0
THRESHOLD_INDEX_FLIPS = 0.0
PROBE_BATCHES = (1, 2, 3, 8, 13, 32)
ENGINE_BATCHES = (1, 8, 32)
TRAINER_PROGRAMS = ("forward", "gradient")
ENGINE_PROGRAMS = tuple(p for p in PROGRAMS if p.startswith("engine"))
PROBE_Q_LEN, PROBE_K_LEN = 4, 12  # an attention probe's queries and the positions they see


def environment() -> dict:
    """What was validated: backend, devices, versions, CPU instruction set, XLA flags."""
    devices = jax.devices()
    return {"backend": jax.default_backend(), "device_kind": devices[0].device_kind, "device_count": len(devices),
            "jax": jax.__version__, "jaxlib": jaxlib.__version__, "cpu_isa": effective_isa(),
            "xla_flags": os.environ.get("XLA_FLAGS", "")}


def batch_invariant(policy: NumericPolicy) -> bool:
    """Whether the policy claims that a row's bits do not depend on its batch: a fixed-tile matmul kernel, tree
    reductions and a dispatch that drops nothing."""
    return policy.batch_invariant_kernel and policy.tree_reduction and policy.capacity_factor is None


def claims_alignment(trainer: NumericPolicy, engine: NumericPolicy) -> bool:
    """A pair claims bitwise alignment when both sides run one batch-invariant policy."""
    return trainer == engine and batch_invariant(trainer)


def _kernels(cfg, policy: NumericPolicy) -> dict[str, tuple[Callable, Callable]]:
    """name -> (make a batch of `b` random rows, the kernel on that batch) at the model's sizes: matmul, RMSNorm
    and softmax, then each layer kind's own probes (`LayerKind.probes`: `attention` for GQA, `mla_attention`
    for MLA, and for DSA also `index_scores` with the attention over the keys it selects)."""
    rng = np.random.default_rng(0)
    w = jnp.asarray(rng.normal(0, cfg.d_model ** -0.5, (cfg.d_model, cfg.vocab_size)), jnp.float32)
    scale = jnp.asarray(rng.normal(1, 0.1, cfg.d_model), jnp.float32)
    found = {
        "matmul": (random_rows(cfg.d_model), lambda x: matmul(x, w, policy)),
        "rms_norm": (random_rows(cfg.d_model), lambda x: rms_norm(x, scale, policy, cfg.rms_eps)),
        "softmax": (random_rows(cfg.vocab_size), lambda x: softmax(x, policy, policy.attn_softmax_dtype)),
    }
    if policy.quantizes_products:  # the block-scaled FP8 product (numerics/fp8.py), its weight quantised once
        found |= {name: (random_rows(cfg.d_model), fn) for name, fn in fp8.probe_kernels(w, policy).items()}
    for kind in kinds.kinds_of(cfg):
        found |= kind.probes(cfg, policy, rng, q_len=PROBE_Q_LEN, k_len=PROBE_K_LEN)
    return found


def probe(cfg, policy: NumericPolicy, kernel: str, batches=PROBE_BATCHES) -> dict:
    """One kernel under `policy`: a row alone, then in each batch size at the first, middle and last position
    (the other rows random). Returns whether every result had the row's bits, and the largest difference."""
    make, fn = _kernels(cfg, policy)[kernel]
    fn = jax.jit(fn)
    row = make(1, 12345)
    alone = np.asarray(fn(row)[0], np.float32)
    cases, max_diff, bitwise = 0, 0.0, True
    for b in batches:
        for pos in sorted({0, b // 2, b - 1}):
            batch = make(b, b).at[pos].set(row[0])
            got = np.asarray(fn(batch)[pos], np.float32)
            cases += 1
            bitwise &= bool(np.array_equal(got, alone))
            max_diff = max(max_diff, float(np.max(np.abs(got - alone))))
    return {"kernel": kernel, "cases": cases, "bitwise_invariant": bitwise, "max_abs_diff": max_diff}


def kernel_gap(cfg, trainer: NumericPolicy, engine: NumericPolicy, kernel: str, batch: int = 4) -> dict:
    """One kernel's trainer-engine gap: the same `batch` random rows through the trainer's and the engine's version
    (e.g. a chunked delta rule against a recurrent one). Returns whether the outputs are bitwise equal and the
    largest absolute and relative differences."""
    make, fn_trainer = _kernels(cfg, trainer)[kernel]
    fn_engine = _kernels(cfg, engine)[kernel][1]
    x = make(batch, 4242)
    a = np.asarray(jax.jit(fn_trainer)(x), np.float64)
    b = np.asarray(jax.jit(fn_engine)(x), np.float64)
    diff = np.abs(a - b)
    return {"kernel": kernel, "bitwise_equal": bool(np.array_equal(a, b)), "max_abs_diff": float(diff.max()),
            "max_rel_diff": float((diff / np.maximum(np.abs(a), 1e-30)).max())}


def _gap_runs(engine_batches) -> list[dict]:
    runs = [dict(run=f"static batch {b}", engine_batches=(b,), schedule="static", prefill_chunk=None)
            for b in engine_batches]
    runs.append(dict(run=f"continuous {max(engine_batches)} slots", engine_batches=(max(engine_batches),),
                     schedule="continuous", prefill_chunk=None))
    runs.append(dict(run=f"chunked prefill (4) batch {max(engine_batches)}", engine_batches=(max(engine_batches),),
                     schedule="static", prefill_chunk=4))
    return runs


def run_check(model: Transformer, trainer: NumericPolicy, engine: NumericPolicy, *,
              engine_batches=ENGINE_BATCHES, probe_batches=PROBE_BATCHES, n_prompts: int | None = None,
              max_new_tokens: int = 16, seed: int = 0, progress: bool = True, replay: str = "none",
              max_k3: float = THRESHOLD_K3, max_route_flips: float = THRESHOLD_ROUTE_FLIPS,
              max_index_flips: float = THRESHOLD_INDEX_FLIPS) -> dict:
    """Run the audit, the probes and the trainer-engine gaps; a JSON-ready report with `passed`. A DSA model's
    gaps also count index flips (`index_flip_rate`, judged like route flips against `max_index_flips`)."""
    from tqdm import tqdm

    from jaxalign.align.compare import compare

    check_backend(trainer, label="trainer policy")  # bad input fails here, before anything long starts
    check_backend(engine, label="engine policy")
    cfg = model.config
    aligned = claims_alignment(trainer, engine)
    sides = {"trainer": trainer} if trainer == engine else {"trainer": trainer, "engine": engine}
    kernels = list(_kernels(cfg, trainer))
    gap_runs = _gap_runs(engine_batches)
    n_prompts = n_prompts or max(engine_batches)
    shared = [k for k in kernels if k in _kernels(cfg, engine)] if len(sides) == 2 else []
    bar = tqdm(total=2 + len(sides) * len(kernels) + len(shared) + len(gap_runs), desc="jaxalign check",
               disable=not progress)

    audits, used = {}, {}
    for side, policy, programs in (("trainer", trainer, TRAINER_PROGRAMS), ("engine", engine, ENGINE_PROGRAMS)):
        bar.set_postfix_str(f"audit {side}")
        with kernel_choice.recording() as used[side]:
            found = audit(lower_programs(model, policy, programs))
        audits[side] = found | {"passed": not found["problems"] and found["products"] > 0}
        bar.update()

    probes = []
    for side, policy in sides.items():
        claimed = batch_invariant(policy)
        for kernel in kernels:
            bar.set_postfix_str(f"probe {side} {kernel}")
            with kernel_choice.recording() as ran:
                result = probe(cfg, policy, kernel, probe_batches)
            status = ("pass" if result["bitwise_invariant"] else "FAIL") if claimed else "info"
            probes.append({"policy": side, **result, "implementation": "; ".join(sorted(ran)) or "lax",
                           "claimed": claimed, "status": status})
            used[side] |= ran
            bar.update()

    kernel_gaps = []  # reported, not judged: the end-to-end gaps below are what the thresholds apply to
    for kernel in shared:
        bar.set_postfix_str(f"kernel gap {kernel}")
        kernel_gaps.append(kernel_gap(cfg, trainer, engine, kernel))
        bar.update()

    gaps = []
    for run in gap_runs:
        bar.set_postfix_str(f"gap {run['run']}")
        result = compare(model, trainer, engine, n_prompts=n_prompts, max_new_tokens=max_new_tokens, seed=seed,
                         engine_batches=run["engine_batches"], schedule=run["schedule"],
                         prefill_chunk=run["prefill_chunk"], replay=replay)["runs"][0]
        index_flips = result.get("index_flip_rate", 0.0)  # a DSA model: engine keys the trainer did not pick
        if aligned:
            ok = result["bitwise_equal_fraction"] == 1.0 and result["route_flip_rate"] == 0.0 and index_flips == 0.0
        else:
            ok = (result["k3_kl"] <= max_k3 and result["route_flip_rate"] <= max_route_flips
                  and index_flips <= max_index_flips)
        gaps.append({"run": run["run"], "schedule": run["schedule"], "prefill_chunk": run["prefill_chunk"],
                     **{k: result[k] for k in ("engine_batch", "kl", "k3_kl", "max_abs_logp_diff",
                                               "bitwise_equal_fraction", "route_flip_rate", "n_tokens")},
                     **({"index_flip_rate": index_flips} if "index_flip_rate" in result else {}),
                     "status": "pass" if ok else "FAIL"})
        bar.update()
    bar.close()

    # FP8 or 4-bit on either side: this backend's e4m3 / e2m1 rounding must be nearest-even with saturation
    sides = (trainer, engine)
    roundings = {}
    if any(p.quantizes_products and not p.lowbit_weights or p.act_tile for p in sides):
        roundings["fp8_rounding"] = fp8.rounding_check()
    if any(p.lowbit_weights for p in sides):
        roundings["e2m1_rounding"] = lowbit.rounding_check()
    passed = (all(a["passed"] for a in audits.values()) and all(p["status"] != "FAIL" for p in probes)
              and all(g["status"] == "pass" for g in gaps) and all(r["passed"] for r in roundings.values()))
    return {"environment": environment(),
            "model": {"family": cfg.family, "config_fingerprint": cfg.fingerprint(),
                      "layer_kinds": list(cfg.layer_kinds),
                      # the form each side's policy selects for each kind (e.g. MLA expanded / absorbed)
                      "forms": {side: {kind.name: kind.form(policy) for kind in kinds.kinds_of(cfg)}
                                for side, policy in (("trainer", trainer), ("engine", engine))}},
            "trainer": str(trainer), "engine": str(engine), "claims_alignment": aligned,
            "replay": replay,
            "thresholds": {"gap": "bitwise" if aligned else
                           f"k3_kl <= {max_k3} and route_flip_rate <= {max_route_flips}"
                           + (f" and index_flip_rate <= {max_index_flips}" if index_layers(cfg) else ""),
                           "probes": "bitwise for a batch-invariant policy, else reported only",
                           "audit": "no product with its precision or accumulation left to the backend"},
            "kernels": {side: sorted(found) for side, found in used.items()},
            "audit": audits, "probes": probes, "kernel_gaps": kernel_gaps, "gaps": gaps,
            **roundings, "passed": passed}


def format_report(result: dict) -> str:
    """The human form: environment, then the three tables and the verdict."""
    from jaxalign import report
    env = result["environment"]
    lines = [f"backend {env['backend']} ({env['device_count']} x {env['device_kind']}), jax {env['jax']}, "
             f"jaxlib {env['jaxlib']}, CPU ISA {env['cpu_isa']}",
             f"XLA_FLAGS: {env['xla_flags'] or '(none)'}",
             f"model {result['model']['family']} ({result['model']['config_fingerprint']}), layer kinds "
             + ", ".join(f"{k} (trainer {result['model']['forms']['trainer'][k]}, engine "
                         f"{result['model']['forms']['engine'][k]})"
                         for k in dict.fromkeys(result['model']['layer_kinds'])),
             f"trainer: {result['trainer']}", f"engine:  {result['engine']}",
             f"claims alignment: {result['claims_alignment']} (gap threshold: {result['thresholds']['gap']})", "",
             "precision audit (products whose precision or accumulation is left to the backend):"]
    rows = [{"side": side, "programs": ", ".join(f"{k} {v}" for k, v in a["per_program"].items()),
             "products": a["products"], "left_to_backend": len(a["problems"]),
             "status": "pass" if a["passed"] else "FAIL"} for side, a in result["audit"].items()]
    lines.append(report.table(rows, ["side", "products", "left_to_backend", "status", "programs"]))
    for side, a in result["audit"].items():
        lines += [f"  {side}: {p}" for p in a["problems"][:10]]
    lines += ["", f"kernel implementations on backend {env['backend']} (numerics/kernels.py):"]
    lines += [f"  {side}: {impl}" for side, found in result["kernels"].items() for impl in found]
    lines += ["", "batch-invariance probes (a row alone vs in batches, at several positions):",
              report.table(result["probes"], ["policy", "kernel", "implementation", "cases", "bitwise_invariant",
                                              "max_abs_diff", "claimed", "status"]),
              *(["", "trainer vs engine per kernel (the same rows through each side's version):",
                 report.table(result["kernel_gaps"], ["kernel", "bitwise_equal", "max_abs_diff", "max_rel_diff"])]
                if result["kernel_gaps"] else []),
              "", "trainer vs engine:",
              report.table(result["gaps"], ["run", "kl", "k3_kl", "max_abs_logp_diff", "bitwise_equal_fraction",
                                            "route_flip_rate"]
                           + (["index_flip_rate"] if any("index_flip_rate" in g for g in result["gaps"]) else [])
                           + ["n_tokens", "status"]),
              "", "PASS" if result["passed"] else "FAIL"]
    for key, what in (("fp8_rounding", "FP8: e4m3"), ("e2m1_rounding", "4-bit: e2m1 (MXFP4)")):
        if key in result:
            r = result[key]
            lines[-2:-2] = ["", f"{what} rounding on this backend vs ml_dtypes (nearest even, saturated): "
                                f"{r['mismatches']} of {r['cases']} differ ({'pass' if r['passed'] else 'FAIL'})"]
    return "\n".join(lines)
