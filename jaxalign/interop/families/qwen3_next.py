"""Qwen3-Next (`qwen3_next`, `Qwen3NextForCausalLM`): the same hybrid as Qwen3.5-MoE's text model (gated DeltaNet
beside gated attention, zero-centred norms, a sigmoid-gated shared expert) with two differences transformers'
modeling file makes:

- the DeltaNet's input projections are fused per key head: `in_proj_qkvz` holds, for each of the Hk key heads,
  that head's query (Dk rows), key (Dk), its H/Hk value heads (H/Hk * Dv) and their output gates z (H/Hk * Dv);
  `in_proj_ba` holds per key head its H/Hk beta rows then its H/Hk decay rows. On load they are split into
  Qwen3.5's `in_proj_qkv` / `in_proj_z` / `in_proj_b` / `in_proj_a` (value head j of key head g is head
  g * H/Hk + j, as transformers' `fix_query_key_value_ordering` reshapes them); `save` fuses them back.
- `norm_topk_prob` is a config field (Qwen3.5 always renormalises).

A checkpoint's multi-token-prediction tensors (`mtp.*`) are left out, as transformers leaves them.
"""

from __future__ import annotations

import numpy as np

from jaxalign.interop.families.qwen3_5_moe import Qwen3_5MoeText


def _layout(cfg) -> tuple[int, int, int, int]:
    """(key heads Hk, key head dim Dk, value heads per key head, value head dim Dv)."""
    hk, h = cfg.linear_n_k_heads, cfg.linear_n_v_heads
    return hk, cfg.linear_k_head_dim, h // hk, cfg.linear_v_head_dim


def _deltanet_prefixes(cfg, top: str):
    return [f"{top}layers.{i}.linear_attn." for i, kind in enumerate(cfg.layer_kinds) if kind == "gated_deltanet"]


class Qwen3Next(Qwen3_5MoeText):
    model_type = "qwen3_next"
    architecture = "Qwen3NextForCausalLM"

    def ignores(self, name: str) -> bool:
        return name.startswith("mtp.")

    def ignored_note(self) -> str:
        return "the multi-token-prediction layers (mtp.*) are not loaded, as transformers does not load them"

    always_renormalises = False  # norm_topk_prob is a config field

    def export_fields(self, cfg, out: dict) -> None:
        super().export_fields(cfg, out)
        out.update(decoder_sparse_step=1, mlp_only_layers=[])

    def tensors_in(self, tensors: dict, cfg) -> dict:
        tensors = dict(tensors)
        hk, dk, r, dv = _layout(cfg)
        for p in _deltanet_prefixes(cfg, self.tensor_prefix):
            for fused in ("in_proj_qkvz", "in_proj_ba"):
                if p + fused + ".weight" not in tensors:
                    raise ValueError(f"checkpoint has no tensor {p}{fused}.weight (qwen3_next fuses the DeltaNet's "
                                     f"input projections per key head)")
            qkvz = tensors.pop(p + "in_proj_qkvz.weight")
            rows = 2 * dk + 2 * r * dv
            if qkvz.ndim != 2 or qkvz.shape[0] != hk * rows:
                raise ValueError(f"{p}in_proj_qkvz.weight has shape {qkvz.shape}; expected ({hk * rows}, d_model)")
            grouped = qkvz.reshape(hk, rows, -1)
            q, k = grouped[:, :dk], grouped[:, dk:2 * dk]
            v, z = grouped[:, 2 * dk:2 * dk + r * dv], grouped[:, 2 * dk + r * dv:]
            d = qkvz.shape[1]
            tensors[p + "in_proj_qkv.weight"] = np.concatenate([x.reshape(-1, d) for x in (q, k, v)])
            tensors[p + "in_proj_z.weight"] = z.reshape(-1, d)
            ba = tensors.pop(p + "in_proj_ba.weight")
            if ba.ndim != 2 or ba.shape[0] != hk * 2 * r:
                raise ValueError(f"{p}in_proj_ba.weight has shape {ba.shape}; expected ({hk * 2 * r}, d_model)")
            grouped = ba.reshape(hk, 2 * r, -1)
            tensors[p + "in_proj_b.weight"] = grouped[:, :r].reshape(-1, ba.shape[1])
            tensors[p + "in_proj_a.weight"] = grouped[:, r:].reshape(-1, ba.shape[1])
        return tensors

    def tensors_out(self, tensors: dict, cfg) -> dict:
        hk, dk, r, dv = _layout(cfg)
        for p in _deltanet_prefixes(cfg, self.tensor_prefix):
            qkv, z = tensors.pop(p + "in_proj_qkv.weight"), tensors.pop(p + "in_proj_z.weight")
            d = qkv.shape[1]
            q, k, v = (qkv[:hk * dk].reshape(hk, dk, d), qkv[hk * dk:2 * hk * dk].reshape(hk, dk, d),
                       qkv[2 * hk * dk:].reshape(hk, r * dv, d))
            tensors[p + "in_proj_qkvz.weight"] = np.concatenate([q, k, v, z.reshape(hk, r * dv, d)], 1).reshape(-1, d)
            b, a = tensors.pop(p + "in_proj_b.weight"), tensors.pop(p + "in_proj_a.weight")
            fused_ba = np.concatenate([b.reshape(hk, r, d), a.reshape(hk, r, d)], 1)
            tensors[p + "in_proj_ba.weight"] = fused_ba.reshape(-1, d)
        return tensors
