"""The Transformer: one Flax NNX definition, run under any NumericPolicy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxalign.model import kinds
from jaxalign.model.config import ModelConfig
from jaxalign.model.hyper import HyperBlock, HyperHead, expand_streams
from jaxalign.model.layers import DenseMLP, Embedding, Linear, RMSNorm
from jaxalign.model.moe import MoE
from jaxalign.model.routing import (RoutingRecord, check_expert_indices, check_index_positions, index_layers,
                                    check_replay_weights)
from jaxalign.model.sharding import constrain
from jaxalign.numerics import NumericPolicy, as_compute, as_param
from jaxalign.numerics.schedule import PolicySchedule, policy_for
from jaxalign.numerics.matmul import matmul
from jaxalign.runtime import require_exact_rounding

ACTIVATION = ("batch", "seq", "act_embed")  # the residual stream between layers (model/sharding.py)
STREAMS = ("batch", "seq", None, "act_embed")  # DeepSeek-V4's hyper-connection streams [B, S, N, D]


class Block(nnx.Module):
    """Pre-norm decoder block: the layer kind's mixer (attention, or any kind in `model.kinds`; in the `attn`
    slot whatever its kind, so parameter paths stay put), then a routed MoE or a dense SwiGLU MLP."""

    def __init__(self, cfg: ModelConfig, moe: bool, *, rngs: nnx.Rngs, layer: int = 0):
        zc = cfg.norm_zero_centred
        self.attn_norm = RMSNorm(cfg.d_model, cfg.rms_eps, "embed", rngs=rngs, zero_centred=zc)
        self.kind = cfg.layer_kinds[layer]
        self.attn = kinds.get(self.kind).build(cfg, layer, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.rms_eps, "embed", rngs=rngs, zero_centred=zc)
        self.mlp = MoE(cfg, rngs=rngs) if moe else DenseMLP(cfg.d_model, cfg.dense_mlp_dim, rngs=rngs)
        self.is_moe = moe

    def __call__(self, x, positions, policy, kv=None, replay=None, layer: int = 0, index_replay=None,
                 replay_weights=None, valid=None):
        """`kv`: this layer's engine state (None in the trainer); `valid` [B, S]: real tokens (None: all)."""
        attn_policy, mlp_policy = policy_for(policy, "attn", layer), policy_for(policy, "mlp", layer)
        x = as_compute(x, attn_policy)  # a no-op unless a PolicySchedule changes dtype between parts
        h, kv, selection = self.attn(self.attn_norm(x, attn_policy), positions, attn_policy, kv, valid=valid,
                                     index_replay=index_replay)
        x = x + h
        routing = None
        if self.is_moe:
            h, routing = self.mlp(self.mlp_norm(x, mlp_policy), mlp_policy, replay, replay_weights)
        else:
            h = self.mlp(self.mlp_norm(x, mlp_policy), mlp_policy)
        return x + h, kv, routing, selection


def check_tokens(tokens, cfg: ModelConfig, name: str = "tokens") -> np.ndarray:
    """Host-side validation: int ids [batch, seq] inside the vocabulary and within max_seq_len."""
    arr = np.asarray(tokens)
    if arr.ndim != 2 or arr.shape[0] == 0 or arr.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty int array [batch, seq], got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{name} must hold integer token ids, got dtype {arr.dtype}")
    if arr.shape[1] > cfg.max_seq_len:
        raise ValueError(f"{name} has length {arr.shape[1]} > max_seq_len = {cfg.max_seq_len}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= cfg.vocab_size:
        raise ValueError(f"{name} holds ids in [{lo}, {hi}]; allowed: 0..{cfg.vocab_size - 1} (vocab_size)")
    return arr


class Transformer(nnx.Module):
    """Decoder-only MoE transformer with float32 master parameters tagged with logical axis names.

    `model(tokens, policy=p)` -> (logits [B, S, V] in p.logits_dtype, RoutingRecord).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.embed = Embedding(config.vocab_size, config.d_model, rngs=rngs)
        moe_layers = set(config.moe_layers)
        block = Block if config.deepseek_v4 is None else HyperBlock  # DeepSeek-V4: hyper-connection streams
        self.blocks = nnx.List([block(config, i in moe_layers, rngs=rngs, layer=i) for i in range(config.n_layers)])
        self.hc_head = None if config.deepseek_v4 is None else HyperHead(config, rngs=rngs)
        self.final_norm = RMSNorm(config.d_model, config.rms_eps, "embed", rngs=rngs,
                                  zero_centred=config.norm_zero_centred)
        self.lm_head = None if config.tie_embeddings else Linear(config.d_model, config.vocab_size,
                                                                 ("embed", "vocab"), rngs=rngs)

    def __call__(self, tokens: jax.Array, *, policy: NumericPolicy | PolicySchedule,
                 positions: jax.Array | None = None,
                 replay: RoutingRecord | jax.Array | None = None,
                 index_replay: jax.Array | None = None,
                 replay_weights: jax.Array | None = None) -> tuple[jax.Array, RoutingRecord]:
        """Full (teacher-forced) forward. `replay`: a RoutingRecord or indices [B, S, moe_layers, k] (R3: the
        expert ids; the combine weights are recomputed). `replay_weights` [B, S, moe_layers, k] (with `replay`;
        R3w): combine weights used as constants for the replayed tokens.
        `index_replay` (models with an indexer): key positions [B, S, index_layers, index_topk] each query of an
        indexing layer attends to (`model/routing.py`).
        `policy` may be a PolicySchedule giving parts of the model other policies."""
        if not isinstance(tokens, jax.core.Tracer):
            check_tokens(tokens, self.config)
        logits, routing, _ = self.forward(tokens, policy, positions=positions, replay=replay,
                                          index_replay=index_replay, replay_weights=replay_weights)
        return logits, routing

    def forward(self, tokens, policy: NumericPolicy, *, positions=None, kv: list | None = None,
                replay=None, index_replay=None, replay_weights=None, valid=None):
        """Forward with optional per-layer engine states (`kv`: one opaque state per layer, from its kind's
        `init_state`). `valid` [B, S] bool marks real tokens (None: all; see `model/kinds/base.py`). Returns
        (logits, RoutingRecord, new states or None); with an indexer the record carries its selections
        (`index_positions`, `index_margins`) on the indexing layers."""
        cfg = self.config
        require_exact_rounding(policy)  # at trace time: once per compiled program
        b, s = tokens.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
        replay_idx = replay.indices if isinstance(replay, RoutingRecord) else replay
        if replay_idx is not None:
            check_expert_indices(replay_idx, cfg, b, s)
        if replay_weights is not None:
            check_replay_weights(replay_weights, replay_idx)
        if index_replay is not None:
            check_index_positions(index_replay, cfg, b, s)
        x = constrain(self.embed(tokens, policy_for(policy, "embed")), ACTIVATION)
        streams = self.hc_head is not None
        if streams:
            x = expand_streams(x, cfg.deepseek_v4.hc_mult)
        new_kv, records, selections = [], [], []
        indexing = index_layers(cfg)
        for i, block in enumerate(self.blocks):
            layer_replay = layer_weights = None
            if block.is_moe and replay_idx is not None:
                layer_replay = replay_idx[:, :, len(records)]
                layer_weights = None if replay_weights is None else replay_weights[:, :, len(records)]
            layer_kv = None if kv is None else kv[i]
            layer_index = None
            if index_replay is not None and i in indexing:
                layer_index = index_replay[:, :, indexing.index(i)]
            extra = {"tokens": tokens} if streams else {}
            x, layer_kv, routing, selection = block(x, positions, policy, layer_kv, layer_replay, layer=i,
                                                    index_replay=layer_index, replay_weights=layer_weights,
                                                    valid=valid, **extra)
            x = constrain(x, STREAMS if streams else ACTIVATION)
            new_kv.append(layer_kv)
            if routing is not None:
                records.append(routing)
            if selection is not None:
                selections.append(selection)
        head = policy_for(policy, "head")
        if streams:
            x = self.hc_head(x, head)
        x = self.final_norm(x, head)
        if self.lm_head is None:
            logits = self.embed.attend(x, head)
        else:
            logits = matmul(x, as_param(self.lm_head.w[...], head), head, out_dtype=head.logits_dtype)
        if head.logit_scale != 1.0:  # the synthetic engine-side gap (policy field logit_scale)
            logits = logits * jnp.asarray(head.logit_scale, logits.dtype)
        logits = constrain(logits, ("batch", "seq", "act_vocab"))
        record = RoutingRecord(indices=jnp.stack([r[0] for r in records], axis=2),
                               weights=jnp.stack([r[1] for r in records], axis=2),
                               margins=jnp.stack([r[2] for r in records], axis=2),
                               index_positions=jnp.stack([c[0] for c in selections], axis=2) if selections else None,
                               index_margins=jnp.stack([c[1] for c in selections], axis=2) if selections else None)
        return logits, record, (None if kv is None else new_kv)
