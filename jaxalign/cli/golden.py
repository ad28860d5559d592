"""`jaxalign golden`: the porting kit -- write a golden file, or check another stack's candidate against one."""

from __future__ import annotations

import os

import json
import tempfile

from jaxalign import loading, report
from jaxalign.cli.args import (UsageError, add_model_args, engine_arg, load_model, param_default, policy_arg,
                               positive_int)
from jaxalign.engines import VllmSpec, open_engine
from jaxalign.files import read_json
from jaxalign.interop import golden, hf


def write_candidate(engine, golden_path: str, path: str) -> str:
    """Have `engine` (one with `score(sequences)`, e.g. a `VllmEngine`) score the sequences of the golden file and
    write its logprobs as a candidate JSONL at `path` (docs/porting.md's format). Returns `path`."""
    content = read_json(golden_path, "the golden file")
    if not isinstance(content, dict) or not isinstance(content.get("sequences"), list):
        raise ValueError(f"{golden_path}: not a golden file (no sequences)")
    scores = engine.score([s["tokens"] for s in content["sequences"]])
    with open(path, "w") as f:
        for s, lp in zip(content["sequences"], scores):
            f.write(json.dumps({"id": s["id"], "tokens": s["tokens"], "logprobs": [None, *lp]}) + "\n")
    return path


def engine_candidate(args) -> str:
    """`golden check --engine vllm[:DTYPE] --model DIR`: the engine scores the golden file's sequences and its
    logprobs are written as a candidate JSONL (to --save-candidate, or a temporary file). Returns the path."""
    if not isinstance(args.engine, VllmSpec):
        raise UsageError(f"--engine {args.engine}: golden check runs an external engine; allowed: vllm[:DTYPE] "
                         "(a jaxalign policy writes its golden file with golden export)")
    if args.model is None:
        raise UsageError("--engine needs --model: the weights the engine loads (the golden file's model)")
    from jaxalign.engines.vllm.process import require_installed
    require_installed()
    read_json(args.golden, "the golden file")  # a bad file fails before the engine starts
    source = args.model if loading.is_transformers_dir(args.model) else load_model(args)
    engine = open_engine(args.engine, source, max_num_seqs=8)
    try:
        path = args.save_candidate or tempfile.mkstemp(prefix="jaxalign-candidate-", suffix=".jsonl")[1]
        return write_candidate(engine, args.golden, path)
    finally:
        engine.close()


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
    if (args.candidate is None) == (args.engine is None):
        raise UsageError("give exactly one of --candidate FILE (another stack's output) and --engine vllm[:DTYPE] "
                         "--model DIR (run the engine here)")
    candidate = args.candidate or engine_candidate(args)
    try:
        result = golden.check_golden(args.golden, candidate, threshold=args.threshold)
    finally:
        if args.candidate is None and args.save_candidate is None:
            os.remove(candidate)
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
    g.add_argument("--candidate", default=None, metavar="FILE",
                   help="the other stack's JSONL: one {\"id\", \"tokens\", \"logprobs\"[, \"routed_experts\"]} "
                        "per sequence (docs/porting.md); or give --engine (default: none)")
    g.add_argument("--engine", type=engine_arg, default=None, metavar="vllm[:DTYPE]",
                   help="instead of --candidate: run vLLM here on --model's weights to score the golden sequences "
                        "(docs/vllm.md) (default: none)")
    g.add_argument("--model", default=None, metavar="DIR|PRESET",
                   help="with --engine: the model (a transformers checkpoint directory, loaded by vLLM as it is, or "
                        "anything --model takes elsewhere, exported) (default: none)")
    g.add_argument("--model-seed", type=int, default=0, help="parameter init seed of a preset --model (default: 0)")
    g.add_argument("--save-candidate", default=None, metavar="FILE",
                   help="with --engine: also keep the engine's candidate JSONL here (default: a temporary file)")
    g.add_argument("--threshold", type=float, default=param_default(golden.check_golden, "threshold"),
                   help="k3 at or below which the two are equivalent")
    g.add_argument("--json", action="store_true", help="print the result as one JSON object")
    g.set_defaults(func=run)
