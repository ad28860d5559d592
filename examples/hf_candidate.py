"""transformers as "the other stack": score a golden file's sequences with a transformers checkpoint and write
a candidate JSONL for `jaxalign golden check`.

    python examples/hf_candidate.py --hf DIR --golden golden.json --out candidate.jsonl \\
        [--dtype float32|bfloat16] [--experts-implementation eager|grouped_mm]

Per sequence it writes {"id", "tokens", "logprobs", "routed_experts"}: logprobs[t] = log p(tokens[t] |
tokens[:t]) (entry 0 null), and the experts each MoE layer's router picked, captured by a forward hook on the
router module (`mlp.gate`), in top-k slot order.
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf", required=True)
    parser.add_argument("--golden", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--experts-implementation", choices=("eager", "grouped_mm"), default=None)
    args = parser.parse_args(argv)
    kwargs = {"dtype": getattr(torch, args.dtype)}
    if args.experts_implementation:
        kwargs["experts_implementation"] = args.experts_implementation
    model = AutoModelForCausalLM.from_pretrained(args.hf, **kwargs).eval()
    routed = []
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "top_k"):
            gate.register_forward_hook(lambda module, inputs, output: routed.append(output[-1].clone()))
    with open(args.golden) as f:
        golden = json.load(f)
    with open(args.out, "w") as out, torch.no_grad():
        for seq in golden["sequences"]:
            routed.clear()
            tokens = torch.tensor([seq["tokens"]])
            logp = torch.log_softmax(model(tokens).logits[0].float(), dim=-1)
            picked = logp[:-1].gather(1, tokens[0, 1:, None])[:, 0].tolist()
            experts = torch.stack(routed, dim=1).tolist() if routed else None  # [seq, moe_layers, k]
            out.write(json.dumps({"id": seq["id"], "tokens": seq["tokens"], "logprobs": [None] + picked,
                                  "routed_experts": experts}) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
