"""`jaxalign experiment countdown` (GRPO on Countdown, one arm per numeric set-up) and `jaxalign experiment study`."""

from __future__ import annotations

import argparse
import dataclasses

from jaxalign import report
from jaxalign.cli.args import (add_json_arg, add_mesh_args, checked_text, field_default, int_list_nonneg,
                               model_preset, output_dir, positive_int, str_list)
from jaxalign.rl.arms import GRAMMAR, parse_arms
from jaxalign.rl.experiment import SUMMARY_COLUMNS, ExperimentConfig, run_experiment
from jaxalign.rl.sft import ANSWERS as SFT_ANSWERS, SFTConfig, parse_answers as parse_sft_answers
from jaxalign.rl.staleness_study import LAGS, StalenessConfig, grid_markdown, run_grid, write_grid_report
from jaxalign.rl.study import StudyConfig, default_experiment, run_study, study_markdown, write_report
from jaxalign.rl import lowbit_study


def _arms(args):
    """The experiment's arms from --arm (repeatable), parsed (a clear error before anything runs);
    ExperimentConfig's default arms when none is given."""
    return parse_arms(tuple(args.arm) if args.arm else field_default(ExperimentConfig, "arms"))


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed a fraction 0 <= F < 1, e.g. 0.15")
    return value


def _count_range(text: str) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition("-")
        rng = (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed N or MIN-MAX, e.g. 3 or 2-3") from None
    if not 2 <= rng[0] <= rng[1] <= 4:
        raise argparse.ArgumentTypeError(f"{text!r}: counts must lie within 2..4 with MIN <= MAX")
    return rng


def run(args) -> int:
    """Run the experiment into --out and print its summary."""
    exp = ExperimentConfig(arms=_arms(args), seeds=tuple(args.seeds), steps=args.steps, model=args.model,
                           prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                           max_new_tokens=args.max_new_tokens, learning_rate=args.learning_rate,
                           ppo_epochs=args.ppo_epochs, is_threshold=args.is_threshold, rs=args.rs,
                           eval_every=args.eval_every,
                           eval_problems=args.eval_problems, problem_count=tuple(args.problem_count),
                           max_number=args.max_number, max_target=args.max_target, held_out=args.held_out,
                           sft=SFTConfig(steps=args.sft_steps, problems=args.sft_problems,
                                         problem_count=tuple(args.problem_count),
                                         max_new_tokens=args.max_new_tokens, answers=args.sft_answers),
                           trainer_mesh=args.trainer_mesh or "", engine_mesh=args.engine_mesh or "")
    output_dir(args.out)  # a file or an unwritable place fails here, after the settings are checked
    summary = run_experiment(exp, args.out, progress=not args.json, jobs=args.jobs)
    if args.json:
        print(report.to_json(summary))
        return 0
    print(report.table([{"arm": a, **v} for a, v in summary["arms"].items()], SUMMARY_COLUMNS))
    print(f"\nwrote {args.out}/summary.md, summary.json and plots: {', '.join(summary['plots'])}")
    return 0


def add_parser(sub) -> None:
    """`jaxalign experiment countdown`: every default is ExperimentConfig's field default (the warm start's:
    its `sft` field's)."""
    exp = lambda name: field_default(ExperimentConfig, name)  # noqa: E731
    p = sub.add_parser("experiment", help="RL experiments")
    esub = p.add_subparsers(dest="experiment", required=True)
    e = esub.add_parser("countdown", help="GRPO on Countdown, one arm per numeric set-up, same warm start, "
                                          "problems and seeds")
    e.add_argument("--arm", action="append", default=[], metavar="SPEC",
                   help=f"an arm, repeatable: {GRAMMAR} (policies may contain commas; see jaxalign.rl.arms); "
                        f"default: {' and '.join(exp('arms'))}")
    e.add_argument("--model", type=model_preset, default=exp("model"),
                   help="model preset (a preset only: the run builds it, warm-starts it and trains it); its "
                        "vocabulary must hold the Countdown tokenizer's, e.g. tiny-glm5, tiny-deepseek-v3; default: "
                        "countdown, or countdown-vllm when an arm's engine is vLLM (heads of 32)")
    e.add_argument("--steps", type=positive_int, default=exp("steps"), help="RL steps of each run")
    e.add_argument("--seeds", type=int_list_nonneg, default=_ints_text(exp("seeds")),
                   help="seeds, one run of each arm per seed, e.g. 0,1,2")
    add_jobs_arg(e)
    for name, what in (("prompts_per_step", "Countdown problems per RL step"),
                       ("group_size", "answers sampled per problem (the GRPO group)"),
                       ("max_new_tokens", "most tokens of an answer"),
                       ("eval_every", "RL steps between held-out evaluations"),
                       ("eval_problems", "held-out problems per evaluation"),
                       ("max_number", "largest number of a problem (numbers lie in 1..N)"),
                       ("max_target", "largest target number of a problem")):
        e.add_argument("--" + name.replace("_", "-"), type=positive_int, default=exp(name), help=what)
    e.add_argument("--learning-rate", type=float, default=exp("learning_rate"), help="AdamW learning rate of RL")
    e.add_argument("--ppo-epochs", type=int, default=exp("ppo_epochs"), help="optimizer steps on each collected batch")
    e.add_argument("--is-threshold", default=exp("is_threshold"),
                   help="the correction of arms that name none: TIS cap C, or lo_hi for IcePop")
    e.add_argument("--rs", type=str_list, default=exp("rs"),
                   help="the correction of arms that name none: rejection rules MODE:THRESHOLD, comma-separated "
                        "(empty string: none)")
    e.add_argument("--problem-count", type=_count_range, default=_count_text(exp("problem_count")),
                   help="how many numbers a problem has: N or MIN-MAX within 2..4")
    e.add_argument("--held-out", type=_fraction, default=exp("held_out"),
                   help="fraction of the problem space held out for evaluation (a hashed split training never "
                        "draws from; evaluation is the split's first --eval-problems); 0: evaluation problems come "
                        "from other seeds and may repeat training problems")
    e.add_argument("--sft-steps", type=int, default=getattr(exp("sft"), "steps"),
                   help="supervised warm-start steps before RL")
    e.add_argument("--sft-problems", type=positive_int, default=getattr(exp("sft"), "problems"),
                   help="problems the warm start trains on")
    e.add_argument("--sft-answers", type=checked_text(parse_sft_answers), default=getattr(exp("sft"), "answers"),
                   help=f"warm-start answers, one of {', '.join(SFT_ANSWERS)}: brute-force solutions; random "
                        "well-formed expressions (RL must then learn correctness); or the solution with "
                        "probability P, else the habit a OP b OP ... (OP + unless given; greedy answers the habit, samples "
                        "hold solutions)")
    e.add_argument("--out", required=True, help="output directory (resumes runs found there)")
    add_json_arg(e)
    add_mesh_args(e)
    e.set_defaults(func=run)
    add_study_parser(esub)
    add_staleness_parser(esub)
    add_lowbit_parser(esub)


def run_lowbit_command(args) -> int:
    """Run (or only report, --report) the low-bit study in --out and print its table and verdict."""
    if args.report:
        result = lowbit_study.write_report(args.out)
    else:
        planned = lowbit_study.default_experiment()
        exp = lowbit_study.default_experiment(seeds=tuple(args.seeds) if args.seeds is not None else planned.seeds,
                                              steps=args.steps or planned.steps)
        output_dir(args.out)
        result = lowbit_study.run_lowbit(exp, args.out, progress=not args.json, jobs=args.jobs,
                                         only=tuple(args.only) if args.only else None)
    print(report.to_json(result) if args.json else lowbit_study.markdown(result))
    return 0


def add_lowbit_parser(esub) -> None:
    """`jaxalign experiment lowbit`: the low-bit study (jaxalign.rl.lowbit_study)."""
    s = esub.add_parser("lowbit", help="low-bit rollouts: FP8 and MXFP4 engines against one bf16 trainer, "
                                       "uncorrected / bypass / R3 / verl-corrected / re-fitted 45%% band / "
                                       "random-drop control / quantisation-aware aligned arm, minibatched GRPO "
                                       "on Countdown with worked steps")
    exp = lowbit_study.default_experiment()
    s.add_argument("--out", required=True, help="study directory (resumes runs found there)")
    s.add_argument("--seeds", type=int_list_nonneg, default=None, help=f"seeds (default {_ints_text(exp.seeds)})")
    s.add_argument("--steps", type=positive_int, default=None, help=f"RL steps of each run (default {exp.steps})")
    s.add_argument("--only", type=str_list, default=None,
                   help="run only these arms (comma-separated names, as lowbit.md lists them); default: all")
    s.add_argument("--report", action="store_true",
                   help="train nothing: rebuild lowbit.json, lowbit.md and the plots from the directory's files")
    add_jobs_arg(s)
    add_json_arg(s)
    s.set_defaults(func=run_lowbit_command)


def add_jobs_arg(parser) -> None:
    """--jobs: runs at once, each in its own process."""
    parser.add_argument("--jobs", type=positive_int, default=1,
                        help="runs at once, each in its own process (results are identical to one at a time)")


def run_study_command(args) -> int:
    """Run (or only report, --report) the seed-regime study in --out and print its table and verdict."""
    if args.report:
        result = write_report(args.out)
    else:
        exp = _study_experiment(args)
        output_dir(args.out)
        result = run_study(StudyConfig(experiment=exp), args.out, progress=not args.json, jobs=args.jobs,
                           only=tuple(args.only) if args.only else None)
    print(report.to_json(result) if args.json else study_markdown(result))
    return 0


def add_study_parser(esub) -> None:
    """`jaxalign experiment study`: the seed-regime study (jaxalign.rl.study)."""
    s = esub.add_parser("study", help="the seed-regime study: engines calibrated to k3 doses at the warm start, "
                                      "one trainer policy, corrected / R3 / random-drop / aligned-fp8 arms, seeds")
    _add_study_args(s, "study", "study.md")
    s.set_defaults(func=run_study_command)


def run_staleness_command(args) -> int:
    """Run (or only report, --report) the staleness x numerics grid in --out and print its table and verdict."""
    if args.report:
        result = write_grid_report(args.out)
    else:
        exp = _study_experiment(args)
        output_dir(args.out)
        result = run_grid(StalenessConfig(experiment=exp, lags=tuple(args.lags)), args.out,
                          progress=not args.json, jobs=args.jobs, only=tuple(args.only) if args.only else None)
    print(report.to_json(result) if args.json else grid_markdown(result))
    return 0


def add_staleness_parser(esub) -> None:
    """`jaxalign experiment staleness`: lag x engine (jaxalign.rl.staleness_study)."""
    s = esub.add_parser("staleness", help="asynchronous rollouts: lag x engine grid, the seed-regime study's "
                                          "settings; which gap (staleness or numerics) dominates learning")
    s.add_argument("--lags", type=int_list_nonneg, default=list(LAGS),
                   help=f"max_lag values, 0 included (default {_ints_text(LAGS)})")
    _add_study_args(s, "grid", "staleness.md")
    s.set_defaults(func=run_staleness_command)


def _add_study_args(parser, what: str, table: str) -> None:
    """The options `experiment study` and `experiment staleness` share: --out, --seeds, --steps, --only,
    --report, --jobs and --json (seeds and steps default to `default_experiment`'s)."""
    exp = default_experiment()
    parser.add_argument("--out", required=True, help=f"{what} directory (resumes runs found there)")
    parser.add_argument("--seeds", type=int_list_nonneg, default=None, help=f"seeds (default {_ints_text(exp.seeds)})")
    parser.add_argument("--steps", type=positive_int, default=None,
                        help=f"RL steps of each run (default {exp.steps})")
    parser.add_argument("--only", type=str_list, default=None,
                        help=f"run only these arms (comma-separated names, as {table} lists them); default: all")
    parser.add_argument("--report", action="store_true",
                        help=f"train nothing: rebuild {table.replace('.md', '.json')}, {table} and the plots from "
                             f"the directory's files")
    add_jobs_arg(parser)
    add_json_arg(parser)


def _study_experiment(args) -> ExperimentConfig:
    """`default_experiment` with the command's --seeds and --steps."""
    exp = default_experiment()
    return dataclasses.replace(exp, seeds=tuple(args.seeds) if args.seeds is not None else exp.seeds,
                               steps=args.steps or exp.steps)


def _ints_text(values) -> str:
    return ",".join(str(v) for v in values)


def _count_text(count: tuple[int, int]) -> str:
    return str(count[0]) if count[0] == count[1] else f"{count[0]}-{count[1]}"
