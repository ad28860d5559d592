"""Regenerate every benchmark: run each script (writing benchmarks/results/*.json), then rewrite every benchmark
table in docs/ from those JSON files, and README.md's results tables (benchmarks/readme_tables.py).

    python benchmarks/run_all.py [--only decode,train_step] [--render-only]

A table lives between `<!-- bench:NAME -->` and `<!-- /bench:NAME -->`; everything between the two markers is
rewritten (the table, the JSON it comes from and the machine and load it was measured on), nothing outside.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
SCRIPTS = ["decode", "decode_qwen35", "train_step", "alignment_cost", "op_profile", "op_profile_decode64",
           "tile_kernel", "tile_layout", "compile_cost", "gap_table", "mesh_gap"]
# a benchmark that is a script run with other arguments: name -> (script, arguments)
VARIANTS = {"op_profile_decode64": ("op_profile", ["--policies", "fp32,dispatch=bucketed;fp32", "--batch", "64",
                                                   "--out", "benchmarks/results/op_profile_decode64.json"]),
            # the gated DeltaNet hybrid: the engine's recurrent decode against transformers' (same weights)
            "decode_qwen35": ("decode", ["--model", "tiny-qwen3.5", "--batches", "1,8,64", "--new-tokens", "32",
                                         "--policy", "fp32,delta=recurrent,dispatch=bucketed",
                                         "--policy", "fp32,delta=recurrent",
                                         "--out", "benchmarks/results/decode_qwen35.json"])}
TIMED = ("decode", "decode_qwen35", "train_step")  # jaxalign vs transformers: take --threads


def _result(name: str) -> dict:
    with open(os.path.join(HERE, "results", f"{name}.json")) as f:
        return json.load(f)


def _machine_note(record: dict) -> str:
    m = record["machine"]
    threads = m.get("threads", {})
    load = (f"; load average {m['load_average_start'][0]:.1f} at start, {m['load_average_end'][0]:.1f} at end"
            if "load_average_start" in m else "")
    n = len(threads.get("cpu_affinity", []))
    pinned = f"; pinned to {n} CPU{'s' if n > 1 else ''} ({n} thread{'s' if n > 1 else ''})" if n else ""
    cpu = m.get("cpu_model", m.get("platform", "?"))
    return f"{cpu}, {m.get('cpu_count')} cores{pinned}{load}"


def _code(text: str) -> str:
    return f"```\n{text}\n```"


def _markdown(rows: list[dict], columns: list[str]) -> str:
    from jaxalign.report import fmt
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _alignment_cost(record: dict) -> str:
    lines = [_code(record["tables"]["alignment_cost_rows"]), "", _code(record["tables"]["alignment_cost_summary"])]
    ablations = [(k[len("ablation "):], e["side"], e["batch"], v) for e in record["summary"]
                 for k, v in e.items() if k.startswith("ablation ")]
    if ablations:
        lines += ["", "Ablations (time / the fastest baseline's; not bitwise aligned, for the breakdown only):", ""]
        lines += [f"- `{p}`: {side} batch {batch}: {v:.2f}x" for p, side, batch, v in ablations]
    return "\n".join(lines)


def _decode(record: dict) -> str:
    return "\n".join([_code(record["tables"]["decode_sides"]), "", _code(record["tables"]["decode_speedup"]), "",
                      "Fastest engine vs fastest transformers at each batch (goal >= 5x at batch 1, 8 and 64):", "",
                      _code(record["tables"]["decode_summary"])])


def _train_step(record: dict) -> str:
    s = record["summary"]
    return "\n".join([_code(record["tables"]["train_step"]), "",
                      f"Fastest jaxalign (`{s['fastest_jaxalign']}`) vs fastest transformers "
                      f"(`{s['fastest_transformers']}`): {s['speedup']:.2f}x (goal >= {s['goal']}x: "
                      f"{'met' if s['goal_met'] else 'not met'})."])


def _op_profile(record: dict) -> str:
    return "\n".join([_code(record["tables"]["op_profile"]), "", "The five ops with the most self time:", "",
                      _code(record["tables"]["op_profile_top"])])


def _gap_table(record: dict) -> str:
    from gap_table import COLUMNS
    from jaxalign.report import table
    return _code(table(record["rows"], COLUMNS))


def _mesh_compare(record: dict) -> str:
    from mesh_gap import COLUMNS
    return _markdown(record["compare_rows"], COLUMNS)


def _mesh_forward(record: dict) -> str:
    from mesh_gap import FORWARD_COLUMNS
    return _markdown(record["forward_rows"], FORWARD_COLUMNS)


def _suite_time(record: dict) -> str:
    return "\n".join([_code(record["tables"]["suite_time"]), "", "The test files that take the most worker-seconds:",
                      "", _code("\n".join(record["tables"]["files"].splitlines()[:12]))])


# marker name -> (result file, renderer)
BLOCKS = {"alignment_cost": ("alignment_cost", _alignment_cost), "decode": ("decode", _decode),
          "decode_qwen35": ("decode_qwen35", _decode),
          "train_step": ("train_step", _train_step), "op_profile": ("op_profile", _op_profile),
          "gap_table": ("gap_table", _gap_table), "suite_time": ("suite_time", _suite_time),
          "mesh_compare": ("mesh_gap", _mesh_compare), "mesh_forward": ("mesh_gap", _mesh_forward)}
DOCUMENTS = ["docs/performance.md", "docs/gap.md", "docs/testing.md", "docs/scaling.md", "docs/policies.md"]


def render(documents=DOCUMENTS) -> list[str]:
    """Rewrite every marked block in `documents` from the result JSON; returns the block names rewritten."""
    done = []
    for doc in documents:
        path = os.path.join(ROOT, doc)
        with open(path) as f:
            text = f.read()

        def replace(match):
            name = match.group(1)
            if name not in BLOCKS:
                raise ValueError(f"{doc}: unknown benchmark block {name!r}; known: {', '.join(BLOCKS)}")
            source, renderer = BLOCKS[name]
            try:
                record = _result(source)
                body = renderer(record)
            except (OSError, KeyError) as exc:  # a result file from before its script wrote what we render
                print(f"{doc}: block {name!r} left as it was: benchmarks/results/{source}.json lacks {exc}")
                return match.group(0)
            done.append(name)
            note = f"_From `benchmarks/results/{source}.json` ({_machine_note(record)})._"
            return f"<!-- bench:{name} -->\n{body}\n\n{note}\n<!-- /bench:{name} -->"

        new = re.sub(r"<!-- bench:(\w+) -->.*?<!-- /bench:\1 -->", replace, text, flags=re.S)
        if new != text:
            with open(path, "w") as f:
                f.write(new)
    return done


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help=f"comma-separated subset of {', '.join(SCRIPTS)}")
    parser.add_argument("--render-only", action="store_true", help="only rewrite the tables from existing JSON")
    parser.add_argument("--threads", type=int,
                        help="CPUs (and threads) per side for the timing scripts (default: all of them)")
    args = parser.parse_args(argv)
    scripts = args.only.split(",") if args.only else SCRIPTS
    unknown = sorted(set(scripts) - set(SCRIPTS))
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {unknown}; allowed: {', '.join(SCRIPTS)}")
    failed = []
    if not args.render_only:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
        for name in scripts:
            start = time.perf_counter()
            extra = [f"--threads={args.threads}"] if args.threads and name in TIMED else []
            print(f"=== {name} {' '.join(extra)}", flush=True)
            script, variant_args = VARIANTS.get(name, (name, []))
            code = subprocess.run([sys.executable, os.path.join(HERE, f"{script}.py"), *variant_args, *extra],
                                  cwd=ROOT, env=env).returncode
            print(f"=== {name}: exit {code}, {time.perf_counter() - start:.0f} s", flush=True)
            if code:
                failed.append(name)
        if failed:
            print(f"FAILED: {', '.join(failed)} (their JSON and tables are unchanged)", flush=True)
    print("rewrote tables:", ", ".join(render()))
    import readme_tables
    readme_tables.main([])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
