"""`jaxalign compare`: generate with the engine policy, score with the trainer policy, report the gap per engine
batch size."""

from __future__ import annotations

from jaxalign import loading, report
from jaxalign.align import external
from jaxalign.align.compare import compare
from jaxalign.cli.args import (COMMAND_MODEL, GAP_PAIR, UsageError, add_generation_args, add_json_arg, add_mesh_args,
                               add_model_args, add_policy_args, add_replay_arg, int_list, load_model, meshes,
                               param_default, positive_int, str_list)
from jaxalign.engine.engine import SCHEDULES
from jaxalign.engines import VllmSpec, open_engine
from jaxalign.engines.vllm.process import require_installed

COMPARE_COLUMNS = ["engine_batch", "kl", "k3_kl", "chi2_token", "max_abs_logp_diff", "bitwise_equal_fraction",
                   "route_flip_rate", "route_token_any_flip", "n_tokens"]


def refuse_for_external(args, engine, options: dict) -> None:
    """UsageError naming the first option (flag -> (value given, value allowed)) that an external engine (`engine`,
    e.g. vllm:bf16) cannot take."""
    for flag, (given, allowed) in options.items():
        if given != allowed:
            raise UsageError(f"{flag} {given} is not available with --engine {engine} (it runs jaxalign's own engine "
                             f"or replays recorded routing); allowed with an external engine: {allowed}")


def open_external(args, model):
    """The external engine --engine names, holding the weights of --model: vLLM loads a transformers checkpoint
    directory as it is, and an exported copy of any other model."""
    source = args.model if loading.is_transformers_dir(args.model) else model
    return open_engine(args.engine, source, max_num_seqs=max(args.engine_batch))


def gap_table(result: dict) -> str:
    """The runs of an external-engine comparison as a table under verl's names."""
    return report.table(result["runs"], list(external.GAP_COLUMNS) + (["status"] if "status" in result["runs"][0]
                                                                     else []))


def run_external(args) -> int:
    """`compare --engine vllm[:DTYPE]`: the external engine's rollouts scored by --trainer per engine batch size,
    and with --rank-policies the nearest jaxalign policy and single field."""
    refuse_for_external(args, args.engine, {"--replay": (args.replay, "none"), "--schedule": (args.schedule, "static"),
                                            "--prefill-chunk": (args.prefill_chunk, None),
                                            "--behaviour-model": (args.behaviour_model, None),
                                            "--trainer-mesh": (args.trainer_mesh, None),
                                            "--engine-mesh": (args.engine_mesh, None)})
    require_installed()  # before the model loads
    model = load_model(args)
    rollouts: list = []
    engine = open_external(args, model)
    try:
        result = external.compare_engine(model, args.trainer, engine, n_prompts=args.prompts,
                                         max_new_tokens=args.max_new_tokens, engine_batches=args.engine_batch,
                                         seed=args.seed, rollouts=rollouts)
    finally:
        engine.close()
    if args.rank_policies is not None:
        presets = None if args.rank_policies == ("all",) else list(args.rank_policies)
        result["ranking"] = external.rank_policies(model, rollouts[0], args.trainer, presets)
    if args.json:
        print(report.to_json(result))
        return 0
    e = result["engine"]
    print(f"model {args.model} ({result['config_fingerprint']}), trainer {args.trainer.compact()}, engine {e['name']} "
          f"{e['version']} ({e['numerics']}); routing {result['routing']}")
    print(gap_table(result))
    print(f"across engine batches: same tokens {result['across_batches']['same_tokens']}, same logprob bits "
          f"{result['across_batches']['same_logprob_bits']}")
    if "ranking" in result:
        r = result["ranking"]
        print(f"\nnearest jaxalign policy to {e['name']}'s logprobs: {r['nearest']} (k3 {r['remaining_k3_kl']:.3g} "
              f"remains; trainer {args.trainer.compact()} at k3 {r['trainer_k3_kl']:.3g})")
        print(report.table(r["presets"], ["policy", "k3_kl", "kl", "max_abs_logp_diff", "bitwise_equal_fraction"]))
        print(f"\none field of {r['nearest']} set on the trainer:")
        print(report.table(r["single_fields"], ["field", "trainer", "nearest", "k3_kl", "k3_kl_change"]))
    return 0


def run(args) -> int:
    """Run `jaxalign.align.compare.compare` and print its runs (an external engine: `run_external`)."""
    if isinstance(args.engine, VllmSpec):
        return run_external(args)
    if args.rank_policies is not None:
        raise UsageError("--rank-policies ranks jaxalign policies against an external engine's logprobs; allowed "
                         "with --engine vllm[:DTYPE]")
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
    add_policy_args(p, **GAP_PAIR, external_engine=True)
    add_replay_arg(p, func=compare, help="router replay mode (r3w: the engine's experts and combine weights; "
                                         "+index: the engine's indexer selections, DSA or CSA)")
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
    p.add_argument("--rank-policies", type=str_list, nargs="?", const=("all",), default=None, metavar="PRESETS",
                   help="with an external --engine: score its tokens under each jaxalign preset (all this backend "
                        "runs, or the comma-separated PRESETS) and rank them by k3, then each field of the nearest "
                        "set alone on --trainer (default: no ranking)")
    add_json_arg(p, "one JSON object with all metrics per engine batch size")
    add_mesh_args(p)
    p.set_defaults(func=run)
