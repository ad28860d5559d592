"""The README's results tables, generated from committed data so that the README cannot drift from it:

- `gap`: the trainer-engine gap without training (benchmarks/results/gap_table.json, `python benchmarks/gap_table.py`);
- `demo`: `jaxalign demo`'s summary (benchmarks/results/demo.json, recorded from a demo run with `--demo DIR`);
- `study`: the seed-regime study (docs/study/study.json, `jaxalign experiment study --out docs/study --report`);
- `staleness`: the lag x engine grid (docs/staleness/staleness.json,
  `jaxalign experiment staleness --out docs/staleness --report`);
- `aggregation`: the MoE aggregation paths on tiny-qwen3.5 (benchmarks/results/aggregation_gap.json,
  `python benchmarks/aggregation_gap.py`).

    python benchmarks/readme_tables.py                  # rewrite the tables in README.md
    python benchmarks/readme_tables.py --check          # exit 1 when README.md's tables differ from the data
    python benchmarks/readme_tables.py --demo runs/demo # first record that demo run as benchmarks/results/demo.json

A table lives between `<!-- table:NAME -->` and `<!-- /table:NAME -->`; everything between the two markers is
rewritten (the table and a line naming the file it comes from), nothing outside. tests/test_readme.py checks that
README.md's tables are what this script writes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from jaxalign.rl.experiment import eval_set

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
README = os.path.join(ROOT, "README.md")
SOURCES = {"gap": "benchmarks/results/gap_table.json", "demo": "benchmarks/results/demo.json",
           "study": "docs/study/study.json", "staleness": "docs/staleness/staleness.json",
           "aggregation": "benchmarks/results/aggregation_gap.json"}
MARKER = re.compile(r"<!-- table:(\w+) -->\n.*?<!-- /table:\1 -->", re.S)


def _fmt(value) -> str:
    """Numbers as the README shows them: 0 as 0, small or large magnitudes in scientific form, else 3 decimals."""
    if value is None:
        return "-"
    if isinstance(value, bool) or isinstance(value, str):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if value == 0:
        return "0"
    return f"{value:.1e}" if abs(value) < 1e-2 or abs(value) >= 1e4 else f"{value:.3f}"


def _pct(value) -> str:
    """A fraction as a percentage: whole percents from 10%, else two significant digits (0 stays 0)."""
    pct = 100 * value
    if pct == 0:
        return "0"
    return f"{pct:.0f}%" if pct >= 10 else f"{pct:.1f}%" if pct >= 1 else f"{pct:.2g}%"


def _reward(value) -> str:
    """A reward (in [0, 1]) or its spread, to 3 decimals."""
    return f"{value:.3f}"


def _markdown(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _machine(record: dict) -> str:
    m = record.get("machine") or {}
    host = record.get("host") or {}
    cpu = m.get("cpu_model") or host.get("cpu")
    cores = f", {m['cpu_count']} cores" if m.get("cpu_count") else ""
    isa = f", XLA:CPU targeting {host['isa']}" if host.get("isa") else ""
    return f"{cpu}{cores}{isa}" if cpu else "host not recorded"


def gap_table(record: dict) -> str:
    """One row per (arm, schedule, engine batch) of `compare` on the `small` model."""
    header = ["pair", "schedule", "engine batch", "k3", "max abs logp diff", "bitwise equal tokens",
              "router decisions flipped"]
    rows = [[r["arm"], r["schedule"], str(r["engine_batch"]), _fmt(r["k3_kl"]), _fmt(r["max_abs_logp_diff"]),
             _pct(r["bitwise_equal_fraction"]), _pct(r["route_flip_rate"])] for r in record["rows"]]
    args = record.get("args", {})
    note = (f"_`{args.get('model', '?')}` model, {args.get('prompts', '?')} prompts x {args.get('new_tokens', '?')} "
            f"new tokens, temperature 1; from `{SOURCES['gap']}` ({_machine(record)})._")
    return _markdown(header, rows) + "\n\n" + note


def demo_table(record: dict) -> str:
    """One row per arm of the demo: held-out reward before and after RL, and what the gap did on the way."""
    header = ["arm", "trainer / engine", "held-out reward: start -> end", "k3 (mean)", "max abs logp diff",
              "tokens rejected", "router decisions flipped", "steps with KL != 0"]
    rows = []
    for arm, v in record["arms"].items():
        rows.append([arm, f"{v['policies']['trainer']} / {v['policies']['engine']}", f"{_reward(v['warm_start_reward'])} -> {_reward(v['final_reward'])}",
                     _fmt(v["mean_k3"]), _fmt(v["max_abs_logp_diff"]), _pct(v["rejected_fraction"]),
                     _pct(v["route_flip_rate"]), f"{int(v['steps_with_nonzero_kl'])} of {record['config']['steps']}"])
    cfg = record["config"]
    note = (f"_{cfg['steps']} GRPO steps of {cfg['prompts_per_step']} problems x {cfg['group_size']} samples, seed "
            f"{', '.join(map(str, cfg['seeds']))}, reward on {eval_set(record)}; from "
            f"`{SOURCES['demo']}` ({_machine(record)})._")
    return _markdown(header, rows) + "\n\n" + note


def study_table(record: dict) -> str:
    """One row per arm of the seed-regime study: its engine's dose, finished seeds, held-out reward from the warm
    start to the end, collapsed seeds and the tests against the aligned arm."""
    header = ["arm", "engine dose (k3)", "seeds", "held-out reward: start -> final", "collapsed", "p (collapse)",
              "final vs aligned", "p (final)", "tokens rejected"]
    rows = [[r["arm"], _fmt(r["dose_k3"]), str(r["seeds"]),
             f"{_reward(r['warm_start_reward'])} -> {_reward(r['final_reward'])} ± {_reward(r['final_reward_std'])}",
             r["collapsed_seeds"], _fmt(r.get("collapse_p")), _signed(r.get("final_vs_aligned")),
             _fmt(r.get("final_p")), _pct(r["rejected_fraction"])] for r in record["rows"]]
    exp = record["settings"]["experiment"]
    note = (f"_Trainer `{record['settings']['trainer']}` in every arm; {exp['steps']} steps; means over the finished "
            f"seeds of {len(exp['seeds'])} planned ({record['runs_finished']} runs); from `{SOURCES['study']}`._")
    return _markdown(header, rows) + "\n\n" + note


def _signed(value) -> str:
    return "-" if value is None else f"{value:+.3f}"


def staleness_table(record: dict) -> str:
    """One row per arm of the lag x engine grid: final held-out reward against the synchronous aligned arm, and
    the mean numerics and staleness k3 of its batches."""
    header = ["engine", "lag", "seeds", "held-out reward: start -> final", "vs sync aligned", "p",
              "numerics k3 (median step)", "staleness k3 (median step)"]
    rows = [[r["engine"], str(r["lag"]), str(r["seeds"]),
             f"{_reward(r['warm_start_reward'])} -> {_reward(r['final_reward'])} ± {_reward(r['final_reward_std'])}",
             _signed(r.get("final_vs_baseline")), _fmt(r.get("final_p")) if r["seeds"] > 1 else "-",
             _fmt(r["numerics_k3_median"]),
             _fmt(r["staleness_k3_median"])] for r in record["rows"]]
    exp = record["settings"]["experiment"]
    note = (f"_Trainer `{record['settings']['trainer']}` in every arm, decoupled objective with "
            f"`{record['settings']['correction']}`; {exp['steps']} steps; means over the finished seeds of "
            f"{len(exp['seeds'])} planned ({record['runs_finished']} runs); from `{SOURCES['staleness']}`._")
    return _markdown(header, rows) + "\n\n" + note


def aggregation_table(record: dict) -> str:
    """One row per top-k: k3 between each pair of aggregation paths (teacher-forced on the same tokens), and for
    eager against grouped what `localize` names and the k3 left with the MoE blocks on the reference path."""
    pairs = list(dict.fromkeys((r["trainer_path"], r["engine_path"]) for r in record["rows"]))
    found = {r["top_k"]: r for r in record["localize"]}
    header = ["top-k"] + [f"k3 {a} vs {b}" for a, b in pairs] + ["localize names", "k3, MoE blocks swapped"]
    rows = []
    for k in record["top_ks"]:
        k3 = {(r["trainer_path"], r["engine_path"]): r["k3_kl"] for r in record["rows"] if r["top_k"] == k}
        loc = found.get(k)
        rows.append([str(k)] + [_fmt(k3[p]) for p in pairs]
                    + ([f"`{loc['culprit']}`", _fmt(loc["k3_moe_from_trainer"])] if loc else ["-", "-"]))
    note = (f"_`{record['preset']}` ({record['model']}) with top-k of its 8 experts varied, paths over "
            f"`{record['base_name']}`; {record['prompts']} prompts x {record['max_new_tokens']} "
            f"new tokens; from `{SOURCES['aggregation']}` ({_machine(record)})._")
    return _markdown(header, rows) + "\n\n" + note


RENDERERS = {"gap": gap_table, "demo": demo_table, "study": study_table, "staleness": staleness_table,
             "aggregation": aggregation_table}


def load(name: str, root: str = ROOT) -> dict:
    """The committed data behind table `name`."""
    with open(os.path.join(root, SOURCES[name])) as f:
        return json.load(f)


def render(text: str, root: str = ROOT) -> str:
    """`text` with every marked table rewritten from the committed data under `root`."""
    def replace(match):
        name = match.group(1)
        if name not in RENDERERS:
            raise ValueError(f"unknown README table {name!r}; known: {', '.join(RENDERERS)}")
        return f"<!-- table:{name} -->\n{RENDERERS[name](load(name, root))}\n<!-- /table:{name} -->"
    return MARKER.sub(replace, text)


def record_demo(run_dir: str, out: str = os.path.join(ROOT, SOURCES["demo"])) -> None:
    """Write a demo run's summary (run_dir/summary.json) and the host it ran on (run_dir/run.json) to `out`."""
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(run_dir, "run.json")) as f:
        run = json.load(f)
    record = {"command": "jaxalign demo", "host": run["host"],
              **{k: summary[k] for k in ("config", "arms", "eval_size", "seconds") if k in summary}}
    with open(out, "w") as f:
        json.dump(record, f, indent=2)
        f.write("\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when README.md differs")
    parser.add_argument("--demo", metavar="RUN_DIR", help="first record this demo run as " + SOURCES["demo"])
    args = parser.parse_args(argv)
    if args.demo:
        record_demo(args.demo)
    with open(README) as f:
        text = f.read()
    new = render(text)
    if args.check:
        if new != text:
            print("README.md's tables differ from the committed data; run python benchmarks/readme_tables.py")
            return 1
        return 0
    if new != text:
        with open(README, "w") as f:
            f.write(new)
    print("README.md tables:", ", ".join(MARKER.findall(new)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
