"""`jaxalign localize`: rank the policy fields, layers and modules that carry the trainer-engine gap."""

from __future__ import annotations

from jaxalign import report
from jaxalign.align.localize import ATTRIBUTIONS, check_attributions, localize
from jaxalign.cli.args import (COMMAND_MODEL, GAP_PAIR, add_generation_args, add_json_arg, add_mesh_args,
                               add_model_args, add_policy_args, add_replay_arg, checked_text, load_model, meshes)
from jaxalign.replay_modes import ENGINE_REPLAY_MODES


def run(args) -> int:
    """Run `jaxalign.align.localize.localize` and print its rankings."""
    trainer_mesh, engine_mesh = meshes(args)
    result = localize(load_model(args), args.trainer, args.engine, n_prompts=args.prompts,
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


def add_parser(sub) -> None:
    """Add the `localize` subcommand."""
    p = sub.add_parser("localize", help="rank the policy fields, layers and modules that carry the gap")
    add_model_args(p, default=COMMAND_MODEL)
    add_policy_args(p, **GAP_PAIR, trainer_help="trainer policy (A)", engine_help="engine policy (B)")
    add_replay_arg(p, func=localize, choices=ENGINE_REPLAY_MODES, help="router replay on the trainer side")
    add_generation_args(p, func=localize)
    p.add_argument("--attribute", type=checked_text(check_attributions), default=",".join(ATTRIBUTIONS),
                   help="comma-separated analyses to run, of " + ", ".join(ATTRIBUTIONS) + " (each variant is a "
                        "program to compile: fields alone skips the n_layers + 4 of the others)")
    add_json_arg(p)
    add_mesh_args(p)
    p.set_defaults(func=run)
