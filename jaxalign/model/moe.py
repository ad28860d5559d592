"""Routed MoE block: router (softmax top-k, top-k softmax or sigmoid group-limited), replay, dispatch, combine,
shared experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jaxalign.model.config import ModelConfig
from jaxalign.model.layers import DenseMLP, Linear, param
from jaxalign.numerics import NumericPolicy, as_param, cast
from jaxalign.numerics.experts import (ClampedSwiGLU, combine, dispatch, normalize_gate_weights, router_sigmoid,
                                       router_sqrtsoftplus, sigmoid)
from jaxalign.numerics.matmul import matmul
from jaxalign.numerics.reduce import softmax
from jaxalign.numerics.select import top_k


def _group_limited(select: jax.Array, cfg: ModelConfig) -> jax.Array:
    """DeepSeek-V3 group limiting: keep the `topk_groups` groups with the largest sum of their top-2 scores;
    other experts' selection scores become -inf (as transformers 5 does)."""
    n = select.shape[0]
    grouped = select.reshape(n, cfg.n_groups, cfg.n_experts // cfg.n_groups)
    group_scores = jnp.sum(top_k(grouped, 2)[0], axis=-1)  # sum of the top-2 scores of each group
    _, top_groups = top_k(group_scores, cfg.topk_groups)
    keep = jnp.zeros((n, cfg.n_groups), bool).at[jnp.arange(n)[:, None], top_groups].set(True)
    keep = jnp.repeat(keep, cfg.n_experts // cfg.n_groups, axis=1)
    return jnp.where(keep, select, jnp.full_like(select, -jnp.inf))


def route(x: jax.Array, router_w: jax.Array, bias: jax.Array | None, cfg: ModelConfig, policy: NumericPolicy,
          replay: jax.Array | None = None, replay_weights: jax.Array | None = None,
          logit_bias: jax.Array | None = None):
    """Choose experts for x [N, D]. `bias`: the sigmoid router's selection-only bias; `logit_bias` (gpt-oss's
    `router_bias`): added to the logits, in the router dtype.

    Returns (idx [N, k] int32 in top-k slot order, weights [N, k] float, margin [N] float). With `replay`
    [N, k] (R3), a token whose row has no -1 uses the replayed indices; its gate weights are gathered from this
    pass's dense scores and then normalised as the family does, so router gradients flow. With `replay_weights`
    [N, k] as well (R3w), those tokens combine with the recorded weights instead (cast to this pass's weight
    dtype), held constant: no gradient reaches the router through them.
    """
    # router parameters are stored in the router dtype (GLM-4.5 / DeepSeek-V3 keep them in f32 in a bf16 model)
    logits = matmul(x, cast(router_w, policy.router_logits_dtype), policy, operand_dtype=policy.router_logits_dtype,
                    out_dtype=policy.router_logits_dtype)
    if logit_bias is not None:
        logits = logits + cast(logit_bias, policy.router_logits_dtype)
    if cfg.router == "topk_softmax":  # gpt-oss: top-k of the logits, the softmax over the k chosen (below)
        scores = cast(logits, policy.router_softmax_dtype)
        select = scores
    elif cfg.router == "softmax_topk":
        scores = softmax(logits, policy, policy.router_softmax_dtype)
        select = scores
    elif cfg.router == "sqrtsoftplus":  # DeepSeek-V4: no groups; the selection bias as DeepSeek-V3's
        scores = router_sqrtsoftplus(logits, policy)
        select = scores if bias is None else scores + cast(cast(bias, policy.router_logits_dtype),
                                                          policy.router_softmax_dtype)
    else:
        scores = router_sigmoid(logits, policy)
        bias = cast(cast(bias, policy.router_logits_dtype), policy.router_softmax_dtype)
        select = _group_limited(scores + bias, cfg)
    select = jax.lax.stop_gradient(select)
    k = cfg.top_k
    top_vals, native_idx = top_k(select, min(k + 1, cfg.n_experts))
    margin = (top_vals[:, k - 1] - top_vals[:, k]).astype(jnp.float32) if k < cfg.n_experts else \
        jnp.full((x.shape[0],), jnp.inf, jnp.float32)
    idx = native_idx[:, :k].astype(jnp.int32)
    if replay is not None:
        replay = replay.astype(jnp.int32)
        use_replay = jnp.all(replay >= 0, axis=-1, keepdims=True)
        idx = jnp.where(use_replay, jnp.clip(replay, 0, cfg.n_experts - 1), idx)
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    sigmoid_router = cfg.router in ("sigmoid_grouped", "sqrtsoftplus")
    if cfg.router == "topk_softmax":
        weights = softmax(weights, policy, policy.router_softmax_dtype)
    else:
        weights = normalize_gate_weights(weights, policy, renormalize=cfg.norm_topk_prob,
                                         epsilon=1e-20 if sigmoid_router else None,
                                         scale=cfg.routed_scaling_factor if sigmoid_router else None)
    if replay is not None and replay_weights is not None:
        recorded = jax.lax.stop_gradient(replay_weights.astype(weights.dtype))
        weights = jnp.where(use_replay, recorded, weights)
    return idx, weights, margin


class MoE(nnx.Module):
    """Routed experts (SwiGLU, stacked [E, ...]) plus optional shared experts; gpt-oss's router bias, expert
    biases and clamped SwiGLU when the config has them."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        e, d, f = cfg.n_experts, cfg.d_model, cfg.expert_dim
        self.router = param(rngs, (d, e), ("embed", "expert_scores"), fan_in=d)
        self.selection_bias = (param(rngs, (e,), ("expert_scores",), init="zeros")
                               if cfg.router in ("sigmoid_grouped", "sqrtsoftplus") else None)
        self.w_gate = param(rngs, (e, d, f), ("expert", "embed", "expert_mlp"), fan_in=d)
        self.w_up = param(rngs, (e, d, f), ("expert", "embed", "expert_mlp"), fan_in=d)
        self.w_down = param(rngs, (e, f, d), ("expert", "expert_mlp", "embed"), fan_in=f)
        # gpt-oss: initialised small and non-zero (transformers initialises the router's bias from a normal too)
        self.router_bias = (param(rngs, (e,), ("expert_scores",), std=0.1) if cfg.router_bias else None)
        if cfg.expert_bias:
            self.b_gate = param(rngs, (e, f), ("expert", "expert_mlp"), std=0.1)
            self.b_up = param(rngs, (e, f), ("expert", "expert_mlp"), std=0.1)
            self.b_down = param(rngs, (e, d), ("expert", "embed"), std=0.1)
        else:
            self.b_gate = self.b_up = self.b_down = None
        self.act = None if cfg.swiglu_alpha is None else ClampedSwiGLU(cfg.swiglu_alpha, cfg.swiglu_limit)
        self.shared = DenseMLP(d, cfg.shared_expert_dim, rngs=rngs) if cfg.shared_expert_dim > 0 else None
        self.shared_gate = Linear(d, 1, ("embed", "unsharded"), rngs=rngs) if cfg.shared_expert_gate else None

    def __call__(self, x: jax.Array, policy: NumericPolicy, replay: jax.Array | None = None,
                 replay_weights: jax.Array | None = None):
        """x [B, S, D]; replay [B, S, k] or None (and with it optionally replay_weights [B, S, k], see `route`).
        Returns (out [B, S, D], (idx, weights, margin) per token)."""
        b, s, d = x.shape
        flat = x.reshape(b * s, d)
        bias = self.selection_bias[...] if self.selection_bias is not None else None
        idx, weights, margin = route(flat, self.router[...], bias, self.cfg, policy,
                                     None if replay is None else replay.reshape(b * s, -1),
                                     None if replay_weights is None else replay_weights.reshape(b * s, -1),
                                     None if self.router_bias is None else self.router_bias[...])
        # FP8 products take the float32 masters (quantised inside, as the engine quantised them at its sync)
        weight = (lambda v: v[...]) if policy.quantizes_products else (lambda v: as_param(v[...], policy))  # noqa: E731
        biases = None
        if self.b_gate is not None:
            biases = tuple(as_param(v[...], policy) for v in (self.b_gate, self.b_up, self.b_down))
        y, kept = dispatch(flat, idx, weight(self.w_gate), weight(self.w_up), weight(self.w_down), policy,
                           biases=biases, act=self.act)
        out = combine(y, idx, jnp.where(kept, weights, jnp.zeros_like(weights)), self.cfg.n_experts, policy)
        if self.shared is not None:
            shared = self.shared(flat, policy)
            if self.shared_gate is not None:
                shared = sigmoid(self.shared_gate(flat, policy), policy) * shared
            out = out + shared
        routing = (idx.reshape(b, s, -1), weights.astype(jnp.float32).reshape(b, s, -1), margin.reshape(b, s))
        return out.reshape(b, s, d), routing
