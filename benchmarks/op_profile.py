"""Where the time of one engine call and one trainer step goes, op by op: an XLA:CPU profile of each policy.

    python benchmarks/op_profile.py [--policies "aligned-bf16;train-fast-bf16;..."] [--model bench]
                                    [--batch 8] [--new-tokens 64] [--train-batch 8] [--train-len 80]

For each policy the engine (greedy, `--batch` prompts of `--prompt-len`, `--new-tokens` new tokens) and the
trainer (jitted forward+backward on [`--train-batch`, `--train-len`], as in alignment_cost.py) are compiled,
then one call of each is recorded with `jax.profiler.trace` (XLA:CPU's thunk executor emits one event per
executed op when `--xla_cpu_enable_xprof_traceme` is set, which this script does before JAX starts; it adds
trace annotations only, not different code). From the Perfetto trace JSON it sums each executed op's *self* time
(its duration minus the ops nested in it on the same thread) by category, and counts op executions:

- `matmul`: YNNPACK/XNNPACK fusions and dots (XLA:CPU hands its matrix products to them);
- `loop`: the self time of `while`/`conditional`/`call` thunks (loop control, and waiting for work a loop
  body dispatched to other threads);
- `data movement`: copies, transposes, slices, pads, concatenates, gathers, scatters, dynamic (update) slices;
- `reduction`: reduce and reduce-window fusions;
- `elementwise`: every other fusion (casts, reduce-precision, arithmetic, transcendentals).

The category comes from the op's HLO name (XLA names a fusion after the ops in it), so it is a heuristic; the
ten ops with the most self time are listed by name as well. Tracing slows a call down (`traced_s` against
`plain_s`), so the shares, not the absolute times, are the figures to read. Writes
benchmarks/results/op_profile.json and prints the tables.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import pin_threads, timed, trainer_step_fn, write_json  # noqa: E402,I001

DEFAULT_POLICIES = "aligned-bf16;train-fast-bf16;serve-fast-bf16;fp32,dispatch=bucketed"
TRACEME_FLAG = "--xla_cpu_enable_xprof_traceme=true"
CATEGORIES = ("matmul", "loop", "data movement", "reduction", "elementwise")
_MATMUL = re.compile(r"^(ynn|xnn|onednn)_fusion|^dot|^custom-call")
_LOOP = re.compile(r"^(while|conditional|call)$")
_MOVEMENT = re.compile(r"^(copy|transpose|bitcast|slice|pad|concatenate|gather|scatter|dynamic-slice|"
                       r"dynamic-update-slice|broadcast|iota|reshape|wrapped_(copy|transpose|slice|pad|"
                       r"concatenate|gather|scatter|dynamic-slice|dynamic-update-slice|broadcast))")
# XLA's profiler events that are not ops: the executor, dispatch, host transfers and Python frames
_NOT_AN_OP = re.compile(r"^\$|^ThunkExecutor|^PjitFunction|^CommonPjRt|^Allocate|^Handle |^Parse|^Slinky|"
                        r"^TfrtCpu|^end: |^PjRt|^Execute")


def op_kind(name: str) -> str:
    """The HLO op name without its numeric suffix: `add_pad_fusion.12` -> `add_pad_fusion`."""
    return re.sub(r"(\.\d+)+$", "", name)


def category(name: str) -> str:
    """The category (CATEGORIES) of an executed op, from its HLO name."""
    kind = op_kind(name)
    if _MATMUL.search(kind):
        return "matmul"
    if _LOOP.search(kind):
        return "loop"
    if "reduce" in kind.replace("reduce-precision", ""):
        return "reduction"
    if _MOVEMENT.search(kind):
        return "data movement"
    return "elementwise"


def self_times(events: list[dict]) -> list[tuple[str, float]]:
    """(op name, self microseconds) for each complete ('X') op event: its duration minus the durations of the
    op events directly nested in it on the same thread."""
    by_thread = collections.defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and not _NOT_AN_OP.search(e.get("name", "")):
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack: list[list] = []  # [event end, name, self time]
        for e in evs:
            start, dur = e["ts"], e.get("dur", 0)
            while stack and stack[-1][0] <= start:
                end, name, own = stack.pop()
                out.append((name, own))
            if stack:
                stack[-1][2] -= dur
            stack.append([start + dur, e["name"], dur])
        out += [(name, own) for _, name, own in stack]
    return out


def profile_call(fn, trace_dir: str) -> dict:
    """Trace one call of `fn` (already compiled) and summarise its ops."""
    import jax
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        traced_s, _ = timed(fn)
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "perfetto_trace.json.gz"), recursive=True))
    if not paths:
        raise RuntimeError(f"jax.profiler.trace wrote no perfetto_trace.json.gz under {trace_dir}")
    with gzip.open(paths[-1]) as f:
        trace = json.load(f)
    ops = self_times(trace["traceEvents"] if isinstance(trace, dict) else trace)
    if not ops:
        raise RuntimeError("the trace holds no XLA op events: was XLA_FLAGS "
                           f"{TRACEME_FLAG} set before JAX started?")
    by_category = {c: 0.0 for c in CATEGORIES}
    counts = {c: 0 for c in CATEGORIES}
    by_kind = collections.Counter()
    for name, own in ops:
        c = category(name)
        by_category[c] += own / 1e6
        counts[c] += 1
        by_kind[op_kind(name)] += own / 1e6
    total = sum(by_category.values())
    return {"traced_s": traced_s, "op_self_s": total, "op_executions": len(ops),
            "seconds": by_category, "executions": counts,
            "share": {c: by_category[c] / total for c in CATEGORIES},
            "top_ops": [{"op": k, "self_s": v, "share": v / total} for k, v in by_kind.most_common(10)]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default=DEFAULT_POLICIES,
                        help="';'-separated policies (a policy may hold commas: aligned-bf16,reduce=xla)")
    parser.add_argument("--model", default="bench")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--train-batch", type=int, default=8)
    parser.add_argument("--train-len", type=int, default=80)
    parser.add_argument("--threads", type=int, help="CPUs (and threads); default: all of this process's")
    parser.add_argument("--out", default="benchmarks/results/op_profile.json")
    args = parser.parse_args(argv)
    n_threads = pin_threads(args.threads)
    if "jax" in sys.modules:
        raise RuntimeError("op_profile must set XLA_FLAGS before JAX is imported")
    os.environ["XLA_FLAGS"] = " ".join([os.environ.get("XLA_FLAGS", ""), TRACEME_FLAG]).strip()
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import jaxalign as ja
    from jaxalign import report
    names = [p for p in args.policies.split(";") if p]
    try:  # a bad policy stops the script before any work
        policies = {name: ja.NumericPolicy.parse(name) for name in names}
    except ValueError as exc:
        parser.error(f"--policies: {exc}")
    model = ja.Transformer(ja.ModelConfig.preset(args.model), rngs=nnx.Rngs(0))
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    prompts = list(rng.integers(1, vocab, (args.batch, args.prompt_len)).astype(np.int32))
    tokens = jnp.asarray(rng.integers(0, vocab, (args.train_batch, args.train_len)), jnp.int32)
    rows = []
    with tempfile.TemporaryDirectory(prefix="jaxalign-op-profile-") as tmp:
        for name in names:
            engine = ja.Engine(model, policies[name])
            step, params = trainer_step_fn(model, policies[name])
            calls = {"engine": lambda e=engine: e.generate(prompts, max_new_tokens=args.new_tokens, temperature=0.0,
                                                          batch_size=args.batch).tokens,
                     "trainer": lambda s=step, p=params: s(p, tokens)}
            for side, fn in calls.items():
                timed(fn)  # compile
                plain_s = min(timed(fn)[0] for _ in range(3))
                prof = profile_call(fn, os.path.join(tmp, f"{name}-{side}"))
                row = {"policy": name, "side": side, "plain_s": plain_s, "traced_s": prof["traced_s"],
                       "op_executions": prof["op_executions"]}
                row.update({f"{c} share": prof["share"][c] for c in CATEGORIES})
                row["matmul executions"] = prof["executions"]["matmul"]
                print(report.table([row], list(row)), flush=True)
                rows.append(dict(row, profile=prof))
    columns = ["policy", "side", "plain_s", "traced_s", "op_executions", "matmul executions"] + \
        [f"{c} share" for c in CATEGORIES]
    tables = {"op_profile": report.table(rows, columns)}
    tables["op_profile_top"] = "\n".join(
        f"{r['policy']} {r['side']}: " + ", ".join(f"{t['op']} {t['share']:.0%}" for t in r["profile"]["top_ops"][:5])
        for r in rows)
    print(f"model {args.model}; engine: batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
          f"greedy; trainer: forward+backward on [{args.train_batch}, {args.train_len}]; {n_threads} threads")
    print(tables["op_profile"])
    print(tables["op_profile_top"])
    write_json(args.out, {"args": vars(args), "rows": rows, "tables": tables})
    return 0


if __name__ == "__main__":
    sys.exit(main())
