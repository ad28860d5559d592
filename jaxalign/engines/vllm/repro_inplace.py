"""A stand-alone reproduction of vLLM's in-place reload fault (docs/vllm.md), for an upstream report: only vLLM,
torch and safetensors, run with the vLLM environment's Python.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 \\
        .venv-vllm/bin/python jaxalign/engines/vllm/repro_inplace.py CHECKPOINT_DIR [--json OUT]

It loads a transformers MoE checkpoint (e.g. a Qwen3MoeForCausalLM saved by `save_pretrained`), scores the prompt
logprobs of a fixed token sequence, then -- for each group of tensors (all, expert weights only, everything but
the experts, attention only, router only) -- reloads that group *with the very same values* through
`llm.collective_rpc("reload_weights", kwargs={"weights_iterator": ..., "is_checkpoint_format": True})` in a fresh
engine and scores the sequence again. A correct reload leaves every logprob bitwise unchanged. Prints one JSON
object: per group, how many logprobs changed and the largest change, and the versions.
"""

import argparse
import glob
import json
import os
import sys

GROUPS = {
    "all": lambda name: True,
    "experts": lambda name: ".experts." in name,
    "all but experts": lambda name: ".experts." not in name,
    "attention": lambda name: ".self_attn." in name,
    "router": lambda name: name.endswith("mlp.gate.weight"),
}


def expert_layout(fresh, tensors, torch) -> dict:
    """Layer 0's fused expert weights (w13, w2) after a fresh load and after an in-place reload of the same
    experts, each compared with the checkpoint's own layout (per-expert gate/up stacked, down): a fresh load holds
    them repacked for the CPU kernel (not the checkpoint layout); if the reload leaves the checkpoint layout, the
    kernel reads unpacked weights."""
    prefix = "model.layers.0.mlp.experts."
    if f"{prefix}0.gate_proj.weight" not in tensors:
        return {"skipped": "not a per-expert gate_proj/up_proj/down_proj checkpoint"}
    n = len({k.split(".")[5] for k in tensors if k.startswith(prefix)})
    raw = {"w13_weight": torch.stack([torch.cat([tensors[f"{prefix}{e}.gate_proj.weight"],
                                                 tensors[f"{prefix}{e}.up_proj.weight"]]) for e in range(n)]),
           "w2_weight": torch.stack([tensors[f"{prefix}{e}.down_proj.weight"] for e in range(n)])}

    def grab(self):
        return {name.rsplit(".", 1)[1]: p.detach().float().clone()
                for name, p in self.model_runner.model.named_parameters()
                if name.startswith("model.layers.0.") and name.endswith(("w13_weight", "w2_weight"))}

    llm = fresh()
    before = llm.collective_rpc(grab)[0]
    experts = [(k, v) for k, v in tensors.items() if ".experts." in k]
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(experts), "is_checkpoint_format": True})
    after = llm.collective_rpc(grab)[0]
    out = {}
    for name, want in raw.items():
        if name not in before:
            return {"skipped": f"no {name} parameter in layer 0"}
        ckpt = want.to(before[name].dtype if before[name].dtype != torch.float32 else torch.bfloat16).float()
        same_shape = before[name].shape == after[name].shape
        out[name] = {"fresh_is_checkpoint_layout": bool(before[name].shape == ckpt.shape and
                                                        torch.equal(before[name], ckpt.to(before[name].dtype))),
                     "reloaded_is_checkpoint_layout": bool(after[name].shape == ckpt.shape and
                                                           torch.equal(after[name], ckpt.to(after[name].dtype))),
                     "reloaded_equals_fresh": bool(same_shape and torch.equal(before[name], after[name]))}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a transformers MoE checkpoint directory (safetensors)")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args()

    import torch
    import vllm
    from safetensors.torch import load_file
    from vllm.inputs import TokensPrompt

    tensors = {}
    for path in sorted(glob.glob(os.path.join(args.checkpoint, "*.safetensors"))):
        tensors.update(load_file(path))
    with open(os.path.join(args.checkpoint, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    sequence = [(7 * i + 3) % vocab for i in range(24)]
    params = vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)

    def fresh():
        return vllm.LLM(model=args.checkpoint, skip_tokenizer_init=True, dtype=args.dtype, seed=0,
                        max_model_len=64, max_num_seqs=1, enforce_eager=True, enable_prefix_caching=False)

    def score(llm):
        out = llm.generate([TokensPrompt(prompt_token_ids=sequence)], params, use_tqdm=False)[0]
        return [out.prompt_logprobs[t][sequence[t]].logprob for t in range(1, len(sequence))]

    llm = fresh()
    before = score(llm)
    rerun = score(llm)
    result = {"vllm": vllm.__version__, "torch": torch.__version__, "checkpoint": args.checkpoint,
              "dtype": args.dtype, "rerun_bitwise": rerun == before, "groups": {}}
    for group, keep in GROUPS.items():
        chosen = [(k, v) for k, v in tensors.items() if keep(k)]
        if not chosen:
            continue
        del llm
        llm = fresh()
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(chosen), "is_checkpoint_format": True})
        after = score(llm)
        diffs = [abs(a - b) for a, b in zip(after, before)]
        result["groups"][group] = {"tensors": len(chosen), "changed": sum(d != 0 for d in diffs),
                                   "of": len(diffs), "max_abs_change": max(diffs)}
    result["expert_layout"] = expert_layout(fresh, tensors, torch)
    print(json.dumps(result, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
