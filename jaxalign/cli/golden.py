"""`jaxalign golden`: the porting kit -- write a golden file, or check another stack's candidate against one."""

from __future__ import annotations

import os

from jaxalign import report
from jaxalign.cli.args import UsageError, add_model_args, load_model, param_default, policy_arg, positive_int
from jaxalign.interop import golden, hf


def run(args) -> int:
    """`golden export` (exit 0) or `golden check` (exit 0 when the candidate passes, 1 when it fails)."""
    if args.golden_command == "export":
        sequences = golden.read_prompts(args.prompts_file)  # a bad file fails before the model loads
        if not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
            raise UsageError(f"--out {args.out}: its directory does not exist")
        model = load_model(args)
        if args.save_hf:
            hf.save(model, args.save_hf)
        content = golden.export_golden(model, sequences, args.policy, args.out, top_n=args.top_n)
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
    add_model_args(g, default=None, required=True)
    g.add_argument("--save-hf", metavar="DIR",
                   help="also write the model as a transformers checkpoint here (default: not written)")
    g.add_argument("--policy", type=policy_arg, default="fp32", metavar="POLICY",
                   help="the policy the sequences are scored under: a preset or a policy string")
    g.add_argument("--prompts-file", required=True, metavar="FILE",
                   help="the sequences: JSONL lines {\"tokens\": [...]} or lines of space-separated token ids")
    g.add_argument("--top-n", type=positive_int, default=param_default(golden.export_golden, "top_n"),
                   help="how many of the most likely tokens to record at each position")
    g.add_argument("--out", required=True, metavar="FILE", help="the golden file to write (JSON)")
    g.set_defaults(func=run)
    g = gsub.add_parser("check", help="compare a candidate JSONL to a golden file (exit 1 when it fails)")
    g.add_argument("--golden", required=True, metavar="FILE", help="the golden file `golden export` wrote")
    g.add_argument("--candidate", required=True, metavar="FILE",
                   help="the other stack's JSONL: one {\"id\", \"tokens\", \"logprobs\"[, \"routed_experts\"]} "
                        "per sequence (docs/porting.md)")
    g.add_argument("--threshold", type=float, default=param_default(golden.check_golden, "threshold"),
                   help="k3 at or below which the two are equivalent")
    g.add_argument("--json", action="store_true", help="print the result as one JSON object")
    g.set_defaults(func=run)
