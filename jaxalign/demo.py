"""`jaxalign demo`: the main job on an embedded default -- a scaled-down run of the seed's experiment.

An SFT warm start on generated two-number Countdown problems (solutions 30% of the time, the habit `a+b`
otherwise: `jaxalign.rl.sft.ANSWERS`), then 40 GRPO steps twice from it: once with trainer and engine computing
probabilities the same way (`aligned-bf16` on both sides), once with a typical trainer/engine pair
(`train-bf16` / `serve-bf16`) protected by verl-style rollout correction. Same problems, same seeds, same
algorithm. Prints the summary table and where the plots are. About 4-5 minutes on 2 CPU cores.
"""

from __future__ import annotations

import os
import time

from jaxalign import report
from jaxalign.rl.experiment import SUMMARY_COLUMNS, ExperimentConfig, run_experiment
from jaxalign.rl.sft import SFTConfig

DEMO = ExperimentConfig(seeds=(0,))  # the experiment's defaults, one seed
QUICK = ExperimentConfig(seeds=(0,), steps=3, eval_every=3, eval_problems=16,
                         sft=SFTConfig(problems=400, steps=40, max_new_tokens=16))


def run_demo(out_dir: str = "runs/demo", json_out: bool = False, quick: bool = False) -> int:
    """Run the demo experiment into `out_dir`; print a table (or JSON). Returns the exit code."""
    start = time.perf_counter()
    summary = run_experiment(QUICK if quick else DEMO, out_dir, progress=not json_out)
    summary["seconds"] = time.perf_counter() - start
    if json_out:
        print(report.to_json(summary))
        return 0
    rows = [{"arm": arm, **vals} for arm, vals in summary["arms"].items()]
    print("\njaxalign demo: Countdown GRPO from one SFT warm start, aligned vs misaligned numerics\n")
    print(report.table(rows, SUMMARY_COLUMNS))
    print(f"\nsummary: {os.path.join(out_dir, 'summary.md')}; plots: {', '.join(summary['plots'])}")
    print(f"finished in {summary['seconds']:.0f} s")
    return 0
