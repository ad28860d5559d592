"""The `jaxalign` command."""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from flax import nnx

from jaxalign import report, runtime
from jaxalign.cli.args import (add_generation_args, checked_text, add_json_arg, add_mesh_args, add_model_args, add_policy_args,
                               add_replay_arg, field_default, meshes, param_default, policy_arg)
from jaxalign.model.config import ModelConfig, preset_names
from jaxalign.model.transformer import Transformer
from jaxalign.numerics import FIELDS, PRESETS
from jaxalign.replay_modes import ENGINE_REPLAY_MODES

COMPARE_COLUMNS = ["engine_batch", "kl", "k3_kl", "chi2_token", "max_abs_logp_diff", "bitwise_equal_fraction",
                   "route_flip_rate", "route_token_any_flip", "n_tokens"]


# the pair compare and localize study by default: a typical trainer and a fast serving engine
GAP_PAIR = {"trainer": "train-bf16", "engine": "serve-bf16"}
COMMAND_MODEL = "small"  # the model preset compare and localize build by default


def _ints(minimum: int, example: str):
    """An argparse type: a comma-separated list of ints, each >= minimum."""
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of ints") from None
        if not values or min(values) < minimum:
            kind = "positive" if minimum == 1 else "non-negative"
            raise argparse.ArgumentTypeError(f"{text!r}: allowed: {kind} ints, e.g. {example}")
        return values
    return parse


_int_list = _ints(1, "1,8,32")
_int_list_nonneg = _ints(0, "0,1,2")


def _model_preset(name: str) -> str:
    if name not in preset_names():
        raise argparse.ArgumentTypeError(f"unknown model preset {name!r}; allowed: {', '.join(preset_names())}")
    return name


def build_model(preset: str, seed: int = 0) -> Transformer:
    """A randomly initialised model of a preset config."""
    return Transformer(ModelConfig.preset(preset), rngs=nnx.Rngs(seed))


def cmd_policies(args) -> int:
    if args.json:
        print(report.to_json({name: p.to_dict() | {"string": str(p)} for name, p in PRESETS.items()}))
        return 0
    rows = [{"field": f"{name} ({spec.key})", **{p: PRESETS[p].to_dict()[name] for p in PRESETS}}
            for name, spec in FIELDS.items()]
    print(report.table(rows, ["field", *PRESETS]))
    print("\nFields:")
    for name, spec in FIELDS.items():
        print(f"  {spec.key:<15} {spec.allowed:<40} {spec.doc}")
    return 0


def cmd_compare(args) -> int:
    from jaxalign.align.compare import compare
    trainer_mesh, engine_mesh = meshes(args)
    result = compare(build_model(args.model, args.model_seed), args.trainer, args.engine, replay=args.replay,
                     n_prompts=args.prompts, max_new_tokens=args.max_new_tokens, engine_batches=args.engine_batch,
                     schedule=args.schedule, prefill_chunk=args.prefill_chunk, seed=args.seed,
                     trainer_mesh=trainer_mesh, engine_mesh=engine_mesh)
    if args.json:
        print(report.to_json(result))
        return 0
    print(f"model {args.model} ({result['config_fingerprint']}), replay {args.replay}, schedule {args.schedule}, "
          f"trainer mesh {result['trainer_mesh']}, engine mesh {result['engine_mesh']}")
    print(f"trainer: {result['trainer']}\nengine:  {result['engine']}")
    print("differs in: " + (", ".join(f"{f} ({a} vs {b})" for f, a, b in result["policy_diff"]) or "nothing"))
    print(report.table(result["runs"], COMPARE_COLUMNS))
    return 0


def cmd_localize(args) -> int:
    from jaxalign.align.localize import localize
    trainer_mesh, engine_mesh = meshes(args)
    result = localize(build_model(args.model, args.model_seed), args.trainer, args.engine, n_prompts=args.prompts,
                      max_new_tokens=args.max_new_tokens, seed=args.seed, replay=args.replay,
                      trainer_mesh=trainer_mesh, engine_mesh=engine_mesh, attribute=args.attribute)
    if args.json:
        print(report.to_json(result))
        return 0
    base = result["baseline"]
    print(f"trainer: {result['trainer']} (mesh {result['trainer_mesh']})\n"
          f"engine:  {result['engine']} (mesh {result['engine_mesh']})")
    print(f"full gap (teacher-forced, {result['n_tokens']} tokens): k3 {report.fmt(base['k3_kl'])}, "
          f"max |dlogp| {report.fmt(base['max_abs_logp_diff'])}, route flips {report.fmt(base['route_flip_rate'])}")
    if "fields" in result["attributed"]:
        print("\nfields, ranked (k3 with only this field switched to the engine's value; k3 removed by switching "
              "only it back):")
        print(report.table(result["fields"], ["field", "trainer", "engine", "k3_alone", "k3_removed", "score"]))
    if "parts" in result["attributed"]:
        print("\nparts, ranked (k3 drop when the part joins the trainer's policy, in model order):")
        print(report.table(result["parts"], ["part", "contribution", "k3_after_joining_trainer"]))
    if "modules" in result["attributed"]:
        print("\nmodule swap (one module kind taken from the trainer's policy in every layer):")
        print(report.table(result["modules"], ["module", "reduction", "k3_with_module_from_trainer",
                                                "route_flip_rate"]))
    if result["culprit"] is not None:
        print(f"\nlargest contributor: {result['culprit']}")
    return 0


def cmd_import_hf(args) -> int:
    from jaxalign.checkpoint import save_model
    from jaxalign.interop import hf
    model = hf.load(args.directory)
    out = save_model(model, args.out, overwrite=args.overwrite)
    print(f"imported {model.config.family} ({model.config.fingerprint()}) from {args.directory} -> {out}")
    return 0


def _golden_model(args) -> Transformer:
    if bool(args.model) == bool(args.hf):
        raise UsageError("golden export needs exactly one of --model PRESET or --hf DIR")
    if args.hf:
        from jaxalign.interop import hf
        return hf.load(args.hf)
    return build_model(args.model, args.model_seed)


def cmd_golden(args) -> int:
    from jaxalign.interop import golden
    if args.golden_command == "export":
        model = _golden_model(args)
        if args.save_hf:
            from jaxalign.interop import hf
            hf.save(model, args.save_hf)
        content = golden.export_golden(model, golden.read_prompts(args.prompts), args.policy, args.out,
                                       top_n=args.top_n)
        print(f"wrote {args.out}: {len(content['sequences'])} sequences under {args.policy}")
        return 0
    result = golden.check_golden(args.golden, args.candidate, threshold=args.threshold)
    if args.json:
        print(report.to_json(result))
    else:
        print(report.table([result], ["k3_kl", "max_abs_logp_diff", "mean_abs_logp_diff", "route_agreement",
                                      "n_tokens", "threshold_k3", "passed"]))
        print("PASS: the candidate is equivalent to the golden file" if result["passed"] else
              "FAIL: k3 above the equivalence threshold")
    return 0 if result["passed"] else 1


def cmd_demo(args) -> int:
    from jaxalign.demo import run_demo
    return run_demo(out_dir=args.out, json_out=args.json, quick=args.quick)


def _str_list(text: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in text.split(",") if v.strip())


def _arms(args):
    """The experiment's arms from --arm (repeatable) or the older --arms NAME,NAME (built-ins only), parsed
    (a clear error before anything runs); ExperimentConfig's default arms when neither is given."""
    from jaxalign.rl.arms import parse_arms
    from jaxalign.rl.experiment import ExperimentConfig
    if args.arm and args.arms:
        raise ValueError("give arms with --arm (repeatable) or --arms NAME,NAME, not both")
    arms = tuple(args.arm) if args.arm else (tuple(args.arms) if args.arms else field_default(ExperimentConfig, "arms"))
    return parse_arms(arms)


def _count_range(text: str) -> tuple[int, int]:
    try:
        lo, _, hi = text.partition("-")
        rng = (int(lo), int(hi or lo))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: allowed N or MIN-MAX, e.g. 3 or 2-3") from None
    if not 2 <= rng[0] <= rng[1] <= 4:
        raise argparse.ArgumentTypeError(f"{text!r}: counts must lie within 2..4 with MIN <= MAX")
    return rng


def cmd_experiment(args) -> int:
    from jaxalign.rl.experiment import SUMMARY_COLUMNS, ExperimentConfig, run_experiment
    from jaxalign.rl.sft import SFTConfig
    from jaxalign.rl.study import STUDY_SEEDS, STUDY_STEPS
    study = args.study is not None
    steps = args.steps if args.steps is not None else (STUDY_STEPS if study else field_default(ExperimentConfig,
                                                                                                "steps"))
    seeds = tuple(args.seeds) if args.seeds is not None else (STUDY_SEEDS if study else field_default(
        ExperimentConfig, "seeds"))
    exp = ExperimentConfig(arms=_arms(args), seeds=seeds, steps=steps, model=args.model,
                           prompts_per_step=args.prompts_per_step, group_size=args.group_size,
                           max_new_tokens=args.max_new_tokens, learning_rate=args.learning_rate,
                           ppo_epochs=args.ppo_epochs, is_threshold=args.is_threshold, rs=args.rs,
                           eval_every=args.eval_every,
                           eval_problems=args.eval_problems, problem_count=tuple(args.problem_count),
                           max_target=args.max_target,
                           sft=SFTConfig(steps=args.sft_steps, problems=args.sft_problems,
                                         problem_count=tuple(args.problem_count),
                                         max_new_tokens=args.max_new_tokens, answers=args.sft_answers),
                           trainer_mesh=args.trainer_mesh or "", engine_mesh=args.engine_mesh or "")
    if args.study:
        from jaxalign.rl.study import run_study, study_markdown
        result = run_study(exp, args.out, progress=not args.json,
                           arms=exp.arms if (args.arm or args.arms) else None)
        print(report.to_json(result) if args.json else study_markdown(result))
        return 0
    summary = run_experiment(exp, args.out, progress=not args.json)
    if args.json:
        print(report.to_json(summary))
        return 0
    print(report.table([{"arm": a, **v} for a, v in summary["arms"].items()], SUMMARY_COLUMNS))
    print(f"\nwrote {args.out}/summary.md, summary.json and plots: {', '.join(summary['plots'])}")
    return 0


def _add_experiment_parser(sub) -> None:
    """`jaxalign experiment countdown`: every default is ExperimentConfig's (or SFTConfig's) field default."""
    from jaxalign.rl.arms import BUILTIN, GRAMMAR
    from jaxalign.rl.experiment import ExperimentConfig
    from jaxalign.rl.sft import ANSWERS as SFT_ANSWERS, SFTConfig, parse_answers as parse_sft_answers
    from jaxalign.rl.study import STUDY_SEEDS, STUDY_STEPS
    exp = lambda name: field_default(ExperimentConfig, name)  # noqa: E731
    p = sub.add_parser("experiment", help="RL experiments")
    esub = p.add_subparsers(dest="experiment", required=True)
    e = esub.add_parser("countdown", help="GRPO on Countdown, one arm per numeric set-up, same warm start, "
                                          "problems and seeds")
    e.add_argument("--arm", action="append", default=[], metavar="SPEC",
                   help=f"an arm, repeatable: {GRAMMAR} (policies may contain commas; see jaxalign.rl.arms); "
                        f"default: {' and '.join(exp('arms'))}")
    e.add_argument("--arms", type=_str_list, default=None,
                   help=f"built-in arm names ({', '.join(BUILTIN)}), comma-separated (older form)")
    e.add_argument("--study", choices=("gap",), default=None,
                   help="gap: the dose-response study over a ladder of engine policies, with and without "
                        "correction (--arm then replaces the ladder)")
    e.add_argument("--model", type=_model_preset, default=exp("model"),
                   help=f"model preset (default {exp('model')}); its vocabulary must hold the Countdown "
                        f"tokenizer's, e.g. tiny-glm5, tiny-deepseek-v3")
    e.add_argument("--steps", type=int, default=None, help=f"default {exp('steps')} (the study: {STUDY_STEPS})")
    e.add_argument("--seeds", type=_int_list_nonneg, default=None,
                   help=f"e.g. 0,1,2 (default {_ints_text(exp('seeds'))}; the study: {_ints_text(STUDY_SEEDS)})")
    for name in ("prompts_per_step", "group_size", "max_new_tokens", "eval_every", "eval_problems", "max_target"):
        e.add_argument("--" + name.replace("_", "-"), type=int, default=exp(name))
    e.add_argument("--learning-rate", type=float, default=exp("learning_rate"))
    e.add_argument("--ppo-epochs", type=int, default=exp("ppo_epochs"), help="optimizer steps on each collected batch")
    e.add_argument("--is-threshold", default=exp("is_threshold"),
                   help="default correction: TIS cap C, or lo_hi for IcePop")
    e.add_argument("--rs", type=_str_list, default=exp("rs"),
                   help="default correction: rejection rules MODE:THRESHOLD, comma-separated (empty string: none)")
    e.add_argument("--problem-count", type=_count_range, default=exp("problem_count"),
                   help="how many numbers a problem has: N or MIN-MAX within 2..4 (default "
                        f"{_count_text(exp('problem_count'))})")
    e.add_argument("--sft-steps", type=int, default=field_default(SFTConfig, "steps"))
    e.add_argument("--sft-problems", type=int, default=field_default(SFTConfig, "problems"))
    e.add_argument("--sft-answers", type=checked_text(parse_sft_answers), default=field_default(SFTConfig, "answers"),
                   help=f"warm-start answers, one of {', '.join(SFT_ANSWERS)}: brute-force solutions; random "
                        "well-formed expressions (RL must then learn correctness); or the solution with "
                        "probability P, else the habit a+b+... (greedy answers the habit, samples hold solutions)")
    e.add_argument("--out", required=True, help="output directory (resumes runs found there)")
    add_json_arg(e)
    add_mesh_args(e)
    e.set_defaults(func=cmd_experiment)


def _ints_text(values) -> str:
    return ",".join(str(v) for v in values)


def _count_text(count: tuple[int, int]) -> str:
    return str(count[0]) if count[0] == count[1] else f"{count[0]}-{count[1]}"


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jaxalign", description=(
        "One MoE transformer under two numeric policies (trainer and rollout engine): measure, localise and "
        "close the gap between them."))
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("policies", help="print every policy preset with all its fields")
    p.add_argument("--json", action="store_true", help="one JSON object: preset -> fields")
    p.set_defaults(func=cmd_policies)

    from jaxalign.check import add_parser as add_check_parser
    add_check_parser(sub)

    p = sub.add_parser("demo", help="the main job: Countdown RL from one warm start, aligned vs misaligned "
                                    "trainer/engine numerics (~3 min on 2 CPU cores)")
    p.add_argument("--out", default="runs/demo", help="output directory (default runs/demo)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--quick", action="store_true", help="a much smaller run (used by the tests)")
    p.set_defaults(func=cmd_demo)

    from jaxalign.align.compare import compare
    from jaxalign.align.localize import ATTRIBUTIONS, check_attributions, localize
    from jaxalign.engine.engine import SCHEDULES
    p = sub.add_parser("compare", help="generate with the engine policy, score with the trainer policy, "
                                       "report KL / k3 / route flips per engine batch size")
    add_model_args(p, default=COMMAND_MODEL, model_type=_model_preset, help=f"model preset (default {COMMAND_MODEL})")
    add_policy_args(p, **GAP_PAIR)
    add_replay_arg(p, func=compare, help="router replay mode (r3w: the engine's experts and combine weights; "
                                         "+index: the engine's DSA index selections)")
    add_generation_args(p, func=compare)
    p.add_argument("--engine-batch", type=_int_list, default=list(param_default(compare, "engine_batches")),
                   help="engine batch sizes, e.g. 1,8,32")
    p.add_argument("--schedule", choices=SCHEDULES, default=param_default(compare, "schedule"))
    p.add_argument("--prefill-chunk", type=int, default=param_default(compare, "prefill_chunk"))
    add_json_arg(p, "one JSON object with all metrics per engine batch size")
    add_mesh_args(p)
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("localize", help="rank the policy fields, layers and modules that carry the gap")
    add_model_args(p, default=COMMAND_MODEL, model_type=_model_preset, help=f"model preset (default {COMMAND_MODEL})")
    add_policy_args(p, **GAP_PAIR, trainer_help="trainer policy (A)", engine_help="engine policy (B)")
    add_replay_arg(p, func=localize, choices=ENGINE_REPLAY_MODES, help="router replay on the trainer side")
    add_generation_args(p, func=localize)
    p.add_argument("--attribute", type=checked_text(check_attributions), default=",".join(ATTRIBUTIONS),
                   help="comma-separated analyses to run, of " + ", ".join(ATTRIBUTIONS) + " (default all; each "
                        "variant is a program to compile: fields alone skips the n_layers + 4 of the others)")
    add_json_arg(p)
    add_mesh_args(p)
    p.set_defaults(func=cmd_localize)

    _add_experiment_parser(sub)

    p = sub.add_parser("import-hf", help="convert a transformers checkpoint directory to a jaxalign (orbax) "
                                         "checkpoint")
    p.add_argument("directory", help="directory with config.json and model.safetensors (or a sharded index)")
    p.add_argument("--out", required=True, help="output checkpoint directory")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    p.set_defaults(func=cmd_import_hf)

    p = sub.add_parser("golden", help="porting kit: write a golden file, or check another stack's candidate")
    gsub = p.add_subparsers(dest="golden_command", required=True)
    g = gsub.add_parser("export", help="score sequences under a policy and write tokens, logprobs, top-n "
                                       "logprobs and routing")
    g.add_argument("--model", type=_model_preset, help="model preset (random init, --model-seed)")
    g.add_argument("--model-seed", type=int, default=0)
    g.add_argument("--hf", help="a transformers checkpoint directory instead of a preset")
    g.add_argument("--save-hf", help="also write the model as a transformers checkpoint here")
    g.add_argument("--policy", type=policy_arg, default=PRESETS["fp32"])
    g.add_argument("--prompts", required=True, help="JSONL {\"tokens\": [...]} or lines of token ids")
    g.add_argument("--top-n", type=int, default=5)
    g.add_argument("--out", required=True)
    g.set_defaults(func=cmd_golden)
    g = gsub.add_parser("check", help="compare a candidate JSONL to a golden file (exit 1 when it fails)")
    g.add_argument("--golden", required=True)
    g.add_argument("--candidate", required=True)
    g.add_argument("--threshold", type=float, default=1e-3, help="k3 at or below which the two are equivalent")
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=cmd_golden)
    return parser


class UsageError(Exception):
    """A command used wrongly (an option combination, a file that is not what the command needs): reported as
    `jaxalign CMD: error: ...` with exit code 2, without a traceback."""


def _raised_by_jaxalign(err: BaseException) -> bool:
    """True when jaxalign's own validation raised `err` (the innermost frame is in the jaxalign package): those
    ValueErrors name the bad value and what is allowed. A ValueError from JAX, NumPy or another library is a bug
    to see with its traceback, not a usage error."""
    frames = traceback.extract_tb(err.__traceback__)
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(_PACKAGE_DIR)


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the jaxalign package


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `jaxalign` console command."""
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "host_devices", None) is not None:
            runtime.configure(host_devices=args.host_devices)
        from jaxalign.distributed import initialize_from_env
        initialize_from_env()  # a no-op unless the environment names a multi-process job (docs/scaling.md)
        return args.func(args)
    except UsageError as err:
        print(f"jaxalign {args.command}: error: {err}", file=sys.stderr)
        return 2
    except ValueError as err:
        if not _raised_by_jaxalign(err):
            raise
        print(f"jaxalign {args.command}: error: {err}", file=sys.stderr)
        return 2

