"""Shared fixtures: tiny models built once per session."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from flax import nnx

from jaxalign import ModelConfig, Transformer
from jaxalign.model.scoring import forward

import os

# tests/multidevice/ needs 8 fake devices, set before JAX starts: tests/test_meshes.py runs it in its own process
collect_ignore = [] if os.environ.get("JAXALIGN_MULTIDEVICE") == "1" else ["multidevice"]

FAMILY_PRESETS = ("tiny", "tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral", "tiny-olmoe", "tiny-glm4-moe")


@functools.lru_cache(maxsize=None)
def build_model(preset: str, seed: int = 0) -> Transformer:
    """A model from a preset, built once per (preset, seed) for the whole session."""
    model = Transformer(ModelConfig.preset(preset), rngs=nnx.Rngs(seed))
    if model.config.router == "sigmoid_grouped":
        # a non-zero selection bias, so tests see it change the selection but not the weights
        bias = np.random.default_rng(seed).normal(0, 0.05, model.config.n_experts)
        for block in model.blocks:
            if block.is_moe:
                block.mlp.selection_bias[...] = bias.astype(np.float32)
    return model


def random_tokens(cfg: ModelConfig, batch: int, seq: int, seed: int = 0) -> np.ndarray:
    """Uniform random token ids [batch, seq]."""
    return np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32)


@pytest.fixture(scope="session")
def tiny_model() -> Transformer:
    return build_model("tiny")


def forward_logits(model: Transformer, tokens, policy, replay=None):
    """Jitted (logits, RoutingRecord); compiled once per (model structure, policy, shapes)."""
    return forward(model, tokens, policy, replay=replay)


@functools.lru_cache(maxsize=None)
def build_lora_model(preset: str = "tiny") -> Transformer:
    """A model with rank-4 adapters on the attention projections and non-zero B (so adapters do something)."""
    from jaxalign.model.lora import add_lora
    model = Transformer(ModelConfig.preset(preset), rngs=nnx.Rngs(0))
    add_lora(model, 4, 8.0)
    rng = np.random.default_rng(0)
    for _, module in nnx.iter_graph(model):
        if getattr(module, "lora_b", None) is not None:
            module.lora_b[...] = rng.normal(0, 0.1, module.lora_b[...].shape).astype(np.float32)
    return model
