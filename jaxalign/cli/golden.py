"""`jaxalign golden`: the porting kit -- write a golden file, or check another stack's candidate against one."""

from __future__ import annotations

from jaxalign import report
from jaxalign.cli.args import UsageError, build_model, model_preset, policy_arg
from jaxalign.model.transformer import Transformer
from jaxalign.numerics import PRESETS


def _golden_model(args) -> Transformer:
    if bool(args.model) == bool(args.hf):
        raise UsageError("golden export needs exactly one of --model PRESET or --hf DIR")
    if args.hf:
        from jaxalign.interop import hf
        return hf.load(args.hf)
    return build_model(args.model, args.model_seed)


def run(args) -> int:
    """`golden export` (exit 0) or `golden check` (exit 0 when the candidate passes, 1 when it fails)."""
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


def add_parser(sub) -> None:
    """Add the `golden export` and `golden check` subcommands."""
    p = sub.add_parser("golden", help="porting kit: write a golden file, or check another stack's candidate")
    gsub = p.add_subparsers(dest="golden_command", required=True)
    g = gsub.add_parser("export", help="score sequences under a policy and write tokens, logprobs, top-n "
                                       "logprobs and routing")
    g.add_argument("--model", type=model_preset, help="model preset (random init, --model-seed)")
    g.add_argument("--model-seed", type=int, default=0)
    g.add_argument("--hf", help="a transformers checkpoint directory instead of a preset")
    g.add_argument("--save-hf", help="also write the model as a transformers checkpoint here")
    g.add_argument("--policy", type=policy_arg, default=PRESETS["fp32"])
    g.add_argument("--prompts", required=True, help="JSONL {\"tokens\": [...]} or lines of token ids")
    g.add_argument("--top-n", type=int, default=5)
    g.add_argument("--out", required=True)
    g.set_defaults(func=run)
    g = gsub.add_parser("check", help="compare a candidate JSONL to a golden file (exit 1 when it fails)")
    g.add_argument("--golden", required=True)
    g.add_argument("--candidate", required=True)
    g.add_argument("--threshold", type=float, default=1e-3, help="k3 at or below which the two are equivalent")
    g.add_argument("--json", action="store_true")
    g.set_defaults(func=run)
