"""`jaxalign compare`: generate with the engine policy, score with the trainer policy, report the gap per engine
batch size."""

from __future__ import annotations

from jaxalign import loading, report
from jaxalign.align.compare import compare
from jaxalign.cli.args import (COMMAND_MODEL, GAP_PAIR, add_generation_args, add_json_arg, add_mesh_args,
                               add_model_args, add_policy_args, add_replay_arg, int_list, load_model, meshes,
                               param_default, positive_int)
from jaxalign.engine.engine import SCHEDULES

COMPARE_COLUMNS = ["engine_batch", "kl", "k3_kl", "chi2_token", "max_abs_logp_diff", "bitwise_equal_fraction",
                   "route_flip_rate", "route_token_any_flip", "n_tokens"]


def run(args) -> int:
    """Run `jaxalign.align.compare.compare` and print its runs."""
    trainer_mesh, engine_mesh = meshes(args)
    result = compare(load_model(args), args.trainer, args.engine, replay=args.replay,
                     n_prompts=args.prompts, max_new_tokens=args.max_new_tokens, engine_batches=args.engine_batch,
                     schedule=args.schedule, prefill_chunk=args.prefill_chunk, seed=args.seed,
                     trainer_mesh=trainer_mesh, engine_mesh=engine_mesh,
                     behaviour_model=(None if args.behaviour_model is None else
                                      loading.load_model(args.behaviour_model, args.behaviour_model_seed)))
    if args.json:
        print(report.to_json(result))
        return 0
    print(f"model {args.model} ({result['config_fingerprint']}), replay {args.replay}, schedule {args.schedule}, "
          f"trainer mesh {result['trainer_mesh']}, engine mesh {result['engine_mesh']}")
    print(f"trainer: {result['trainer']}\nengine:  {result['engine']}")
    print("differs in: " + (", ".join(f"{f} ({a} vs {b})" for f, a, b in result["policy_diff"]) or "nothing"))
    split = [c for c in ("numerics/k3_kl", "staleness/k3_kl", "numerics/share") if c in result["runs"][0]]
    print(report.table(result["runs"], COMPARE_COLUMNS + split))
    return 0


def add_parser(sub) -> None:
    """Add the `compare` subcommand."""
    p = sub.add_parser("compare", help="generate with the engine policy, score with the trainer policy, "
                                       "report KL / k3 / route flips per engine batch size")
    add_model_args(p, default=COMMAND_MODEL)
    add_policy_args(p, **GAP_PAIR)
    add_replay_arg(p, func=compare, help="router replay mode (r3w: the engine's experts and combine weights; "
                                         "+index: the engine's DSA index selections)")
    add_generation_args(p, func=compare)
    p.add_argument("--engine-batch", type=int_list, default=list(param_default(compare, "engine_batches")),
                   help="engine batch sizes, comma-separated, e.g. 1,8,32: one run each")
    p.add_argument("--schedule", choices=SCHEDULES, default=param_default(compare, "schedule"),
                   help="static: each batch of prompts prefilled and decoded together; continuous: a prompt takes "
                        "a slot another one freed")
    p.add_argument("--prefill-chunk", type=positive_int, default=param_default(compare, "prefill_chunk"),
                   help="static schedule: prefill prompts in chunks of this many tokens (default: the whole prompt "
                        "at once)")
    p.add_argument("--behaviour-model", default=None, metavar="MODEL",
                   help="older weights of the same model (as --model takes them): the engine generates with them "
                        "and each run adds the numerics/staleness split of the log ratio (default: none, the "
                        "engine generates with --model)")
    p.add_argument("--behaviour-model-seed", type=int, default=0,
                   help="initialisation seed when --behaviour-model is a preset (default: 0)")
    add_json_arg(p, "one JSON object with all metrics per engine batch size")
    add_mesh_args(p)
    p.set_defaults(func=run)
