"""An independent float64 NumPy forward of the jaxalign Transformer, written from the architecture description
(not from the JAX code), used as the numeric reference in tests."""

from __future__ import annotations

import numpy as np
from flax import nnx


def params_f64(model) -> dict:
    """The model's parameters as a nested dict of float64 numpy arrays."""
    state = nnx.state(model, nnx.Param)
    return _to_numpy(nnx.to_pure_dict(state))


def _to_numpy(tree):
    if isinstance(tree, dict):
        return {k: _to_numpy(v) for k, v in tree.items()}
    return np.asarray(tree, np.float64)


def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, pos, theta, rotary_dim):
    if rotary_dim < x.shape[-1]:
        return np.concatenate([_rope(x[..., :rotary_dim], pos, theta, rotary_dim), x[..., rotary_dim:]], -1)
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    ang = pos[..., None].astype(np.float64) * inv  # [B, S, d/2]
    cos = np.cos(np.concatenate([ang, ang], -1))[:, :, None, :]
    sin = np.sin(np.concatenate([ang, ang], -1))[:, :, None, :]
    rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _lin(p, x):
    y = x @ p["w"]
    return y + p["b"] if "b" in p and p["b"] is not None else y


def _attention(p, cfg, x, pos):
    b, s, _ = x.shape
    q, k, v = _lin(p["q_proj"], x), _lin(p["k_proj"], x), _lin(p["v_proj"], x)
    if cfg.qk_norm == "proj":
        q, k = _rms(q, p["q_norm"]["scale"], cfg.rms_eps), _rms(k, p["k_norm"]["scale"], cfg.rms_eps)
    q = q.reshape(b, s, cfg.n_heads, cfg.head_dim)
    k = k.reshape(b, s, cfg.n_kv_heads, cfg.head_dim)
    v = v.reshape(b, s, cfg.n_kv_heads, cfg.head_dim)
    if cfg.qk_norm == "head":
        q, k = _rms(q, p["q_norm"]["scale"], cfg.rms_eps), _rms(k, p["k_norm"]["scale"], cfg.rms_eps)
    q, k = _rope(q, pos, cfg.rope_theta, cfg.rotary_dim), _rope(k, pos, cfg.rope_theta, cfg.rotary_dim)
    rep = cfg.n_heads // cfg.n_kv_heads
    k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(cfg.head_dim)
    causal = np.tril(np.ones((s, s), bool))
    scores = np.where(causal, scores, -np.inf)
    scores = scores - scores.max(-1, keepdims=True)
    probs = np.exp(scores)
    probs /= probs.sum(-1, keepdims=True)
    out = np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, -1)
    return _lin(p["o_proj"], out)


def _rope_interleaved(x, pos, theta):
    """DeepSeek's interleaved RoPE: pair (x[2i], x[2i+1]) rotated by frequency i; output [evens', odds']."""
    d = x.shape[-1]
    ang = pos[..., None].astype(np.float64) * (1.0 / theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    cos, sin = np.cos(ang)[:, :, None, :], np.sin(ang)[:, :, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def _mla_attention(p, cfg, x, pos):
    """Multi-head latent attention in its expanded form (keys and values up-projected per head)."""
    b, s, _ = x.shape
    h, dn, dr, dv, r = cfg.n_heads, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank is None:
        q = _lin(p["q_proj"], x)
    else:
        q = _lin(p["q_b_proj"], _rms(_lin(p["q_a_proj"], x), p["q_a_norm"]["scale"], 1e-6))
    q = q.reshape(b, s, h, dn + dr)
    rot = _rope_interleaved if cfg.rope_interleave else (lambda y, ps, th: _rope(y, ps, th, y.shape[-1]))
    q = np.concatenate([q[..., :dn], rot(q[..., dn:], pos, cfg.rope_theta)], -1)
    compressed = _lin(p["kv_a_proj"], x)
    latent = _rms(compressed[..., :r], p["kv_a_norm"]["scale"], 1e-6)
    k_rope = rot(compressed[..., None, r:], pos, cfg.rope_theta)  # [B, S, 1, dr]
    kv = (latent @ p["kv_b_proj"]["w"]).reshape(b, s, h, dn + dv)
    k = np.concatenate([kv[..., :dn], np.broadcast_to(k_rope, (b, s, h, dr))], -1)
    v = kv[..., dn:]
    scores = np.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(dn + dr)
    keep = np.broadcast_to(np.tril(np.ones((s, s), bool)), (b, s, s))
    chosen = None
    if cfg.index_topk:
        q_latent = _rms(_lin(p["q_a_proj"], x), p["q_a_norm"]["scale"], 1e-6)
        chosen = _indexer(p["indexer"], cfg, x, q_latent, pos)
        picked = (np.arange(s)[None, None, :, None] == chosen[:, :, None, :]).any(-1)  # [B, S, T]
        keep = keep & picked
    scores = np.where(keep[:, None], scores, -np.inf)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return _lin(p["o_proj"], np.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, -1)), chosen


def _indexer(p, cfg, x, q_latent, pos):
    """DSA indexer: key positions [B, S, index_topk] each query keeps (-1 past the visible keys); the best
    scores first, ties to the earlier key."""
    b, s, _ = x.shape
    h, d, r = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    q = _lin(p["wq_b"], q_latent).reshape(b, s, h, d)
    q = np.concatenate([_rope_interleaved(q[..., :r], pos, cfg.rope_theta), q[..., r:]], -1)
    k = _lin(p["wk"], x)
    k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + 1e-6) * p["k_norm_scale"] \
        + p["k_norm_bias"]
    k = np.concatenate([_rope_interleaved(k[:, :, None, :r], pos, cfg.rope_theta)[:, :, 0], k[..., r:]], -1)
    per_head = np.maximum(np.einsum("bshd,btd->bsht", q, k) / np.sqrt(d), 0.0)
    weights = _lin(p["weights_proj"], x) / np.sqrt(h)
    scores = np.einsum("bsh,bsht->bst", weights, per_head)
    scores = np.where(np.tril(np.ones((s, s), bool)), scores, -np.inf)
    order = np.argsort(-scores, -1, kind="stable")[..., : cfg.index_topk]
    visible = np.take_along_axis(np.isfinite(scores), order, -1)
    out = np.where(visible, order, -1)
    if out.shape[-1] < cfg.index_topk:
        out = np.concatenate([out, -np.ones((b, s, cfg.index_topk - out.shape[-1]), out.dtype)], -1)
    return out


def _mlp(p, x):
    return _lin(p["down"], _silu(_lin(p["gate"], x)) * _lin(p["up"], x))


def _route(p, cfg, x, replay):
    logits = x @ p["router"]
    n = x.shape[0]
    if cfg.router == "softmax_topk":
        e = np.exp(logits - logits.max(-1, keepdims=True))
        scores = e / e.sum(-1, keepdims=True)
        select = scores
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
        select = scores + p["selection_bias"]
        per = cfg.n_experts // cfg.n_groups
        grouped = select.reshape(n, cfg.n_groups, per)
        gscore = np.sort(grouped, -1)[..., -2:].sum(-1)
        top_groups = np.argsort(-gscore, -1, kind="stable")[:, : cfg.topk_groups]
        keep = np.zeros((n, cfg.n_groups), bool)
        np.put_along_axis(keep, top_groups, True, axis=1)
        select = np.where(np.repeat(keep, per, axis=1), select, -np.inf)
    idx = np.argsort(-select, -1, kind="stable")[:, : cfg.top_k]
    if replay is not None:
        use = np.all(replay >= 0, -1, keepdims=True)
        idx = np.where(use, replay, idx)
    w = np.take_along_axis(scores, idx, -1)
    if cfg.norm_topk_prob:
        w = w / (w.sum(-1, keepdims=True) + (1e-20 if cfg.router == "sigmoid_grouped" else 0.0))
    if cfg.router == "sigmoid_grouped":
        w = w * cfg.routed_scaling_factor
    return idx, w


def _moe(p, cfg, x, replay):
    b, s, d = x.shape
    flat = x.reshape(-1, d)
    idx, w = _route(p, cfg, flat, None if replay is None else replay.reshape(b * s, -1))
    out = np.zeros_like(flat)
    for n in range(flat.shape[0]):
        for j in range(cfg.top_k):
            e = idx[n, j]
            h = _silu(flat[n] @ p["w_gate"][e]) * (flat[n] @ p["w_up"][e])
            out[n] += w[n, j] * (h @ p["w_down"][e])
    if "shared" in p and p["shared"] is not None:
        shared = _mlp(p["shared"], flat)
        if "shared_gate" in p and p["shared_gate"] is not None:
            shared = shared / (1.0 + np.exp(-_lin(p["shared_gate"], flat)))
        out = out + shared
    return out.reshape(b, s, d), idx.reshape(b, s, -1)


def forward(model, tokens, replay=None, return_index=False):
    """float64 logits [B, S, V] and expert indices [B, S, moe_layers, k] (and with `return_index`, a DSA model's
    indexer selections [B, S, layers, index_topk]). `replay`: indices or None."""
    cfg = model.config
    p = params_f64(model)
    tokens = np.asarray(tokens)
    b, s = tokens.shape
    pos = np.broadcast_to(np.arange(s), (b, s))
    x = p["embed"]["table"][tokens]
    routes, selections = [], []
    for i in range(cfg.n_layers):
        bp = p["blocks"][i]
        normed = _rms(x, bp["attn_norm"]["scale"], cfg.rms_eps)
        if cfg.attention_kind == "mla":
            h, chosen = _mla_attention(bp["attn"], cfg, normed, pos)
            selections.append(chosen)
        else:
            h = _attention(bp["attn"], cfg, normed, pos)
        x = x + h
        h = _rms(x, bp["mlp_norm"]["scale"], cfg.rms_eps)
        if i in cfg.moe_layers:
            layer_replay = None if replay is None else np.asarray(replay)[:, :, len(routes)]
            h, idx = _moe(bp["mlp"], cfg, h, layer_replay)
            routes.append(idx)
        else:
            h = _mlp(bp["mlp"], h)
        x = x + h
    x = _rms(x, p["final_norm"]["scale"], cfg.rms_eps)
    logits = x @ (p["embed"]["table"].T if cfg.tie_embeddings else p["lm_head"]["w"])
    if return_index:
        return logits, np.stack(routes, axis=2), np.stack(selections, axis=2)
    return logits, np.stack(routes, axis=2)
