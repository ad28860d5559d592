"""`jaxalign check`: the argparse part of `jaxalign.check` (precision audit, batch-invariance probes,
trainer-engine gaps; exit 0 when every check passes, 1 otherwise, 2 on bad input)."""

from __future__ import annotations

from jaxalign import report
from jaxalign.align import external
from jaxalign.check import (CHECK_MODEL, CHECK_PAIR, ENGINE_BATCHES, PROBE_BATCHES, THRESHOLD_INDEX_FLIPS,
                            THRESHOLD_K3, THRESHOLD_ROUTE_FLIPS, environment, format_report, run_check)
from jaxalign.cli.args import (add_generation_args, add_json_arg, add_model_args, add_policy_args, add_replay_arg,
                               int_list, load_model)
from jaxalign.cli.compare import gap_table, open_external, refuse_for_external
from jaxalign.engines import VllmSpec
from jaxalign.engines.vllm.process import require_installed
from jaxalign.numerics.precision import check_backend


def add_parser(sub) -> None:
    """Add the `check` subcommand to the `jaxalign` command's subparsers."""
    p = sub.add_parser("check", help="validate a model and a trainer/engine policy pair on this backend: precision "
                                     "audit, batch-invariance probes, trainer-engine gaps (exit 1 on a failure)")
    add_model_args(p, default=CHECK_MODEL)
    add_policy_args(p, **CHECK_PAIR, external_engine=True)
    p.add_argument("--engine-batch", type=int_list, default=ENGINE_BATCHES,
                   help="engine batch sizes, comma-separated; the largest also runs continuous batching and "
                        "chunked prefill")
    p.add_argument("--probe-batch", type=int_list, default=PROBE_BATCHES,
                   help="batch sizes of the kernel probes, comma-separated")
    add_generation_args(p, func=run_check, prompts_help="prompts per run (default: the largest engine batch)")
    add_replay_arg(p, func=run_check, help="router replay on the trainer side (r3: the engine's experts)")
    p.add_argument("--max-k3", type=float, default=THRESHOLD_K3,
                   help="largest k3 a non-aligned pair may show (the seed's 'equivalent')")
    p.add_argument("--max-route-flips", type=float, default=THRESHOLD_ROUTE_FLIPS,
                   help="largest fraction of router decisions a non-aligned pair may flip")
    p.add_argument("--max-index-flips", type=float, default=THRESHOLD_INDEX_FLIPS,
                   help="largest fraction of DSA key selections a non-aligned pair may flip")
    add_json_arg(p, "print the report as one JSON object (docs/check.md)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run_external(args) -> int:
    """`check --engine vllm[:DTYPE]`: the trainer-engine gap part of the check against the external engine, at
    each --engine-batch, judged against --max-k3 (the precision audit and kernel probes are jaxalign-only; an
    engine that records no routing gives no route flips to judge). Exit 0 when every run passes, 1 otherwise."""
    check_backend(args.trainer, label="--trainer")
    refuse_for_external(args, args.engine, {"--replay": (args.replay, "none")})
    require_installed()  # before the model loads
    model = load_model(args)
    engine = open_external(args, model)
    try:
        found = external.compare_engine(model, args.trainer, engine, n_prompts=args.prompts or max(args.engine_batch),
                                        max_new_tokens=args.max_new_tokens, engine_batches=args.engine_batch,
                                        seed=args.seed)
    finally:
        engine.close()
    for run in found["runs"]:
        run["status"] = "pass" if run["k3_kl"] <= args.max_k3 else "FAIL"
    result = {"environment": environment(), "model": {"family": found["model"],
                                                      "config_fingerprint": found["config_fingerprint"]},
              "trainer": found["trainer"], "engine": found["engine"], "routing": found["routing"],
              "thresholds": {"gap": f"k3_kl <= {args.max_k3}"},
              "not_run": "precision audit and kernel probes: they inspect jaxalign's own programs",
              "across_batches": found["across_batches"], "gaps": found["runs"],
              "passed": all(r["status"] == "pass" for r in found["runs"])}
    if args.json:
        print(report.to_json(result))
    else:
        e = result["engine"]
        print(f"model {args.model} ({result['model']['config_fingerprint']}), trainer {args.trainer.compact()}, engine "
              f"{e['name']} {e['version']} ({e['numerics']}); routing {result['routing']}")
        print(f"gap threshold: {result['thresholds']['gap']}; not run: {result['not_run']}")
        print(gap_table({"runs": found["runs"]}))
        print("PASS" if result["passed"] else "FAIL")
    return 0 if result["passed"] else 1


def run(args) -> int:
    """The `jaxalign check` command: exit 0 when every check passes, 1 otherwise (2 on bad input)."""
    if isinstance(args.engine, VllmSpec):
        return run_external(args)
    check_backend(args.trainer, label="--trainer")  # before the model loads
    check_backend(args.engine, label="--engine")
    result = run_check(load_model(args), args.trainer, args.engine,
                       engine_batches=args.engine_batch, probe_batches=args.probe_batch, n_prompts=args.prompts,
                       max_new_tokens=args.max_new_tokens, seed=args.seed, progress=not args.no_progress,
                       replay=args.replay, max_k3=args.max_k3, max_route_flips=args.max_route_flips,
                       max_index_flips=args.max_index_flips)
    print(report.to_json(result) if args.json else format_report(result))
    return 0 if result["passed"] else 1
