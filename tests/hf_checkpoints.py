"""Helpers for tests that load a transformers checkpoint they saved themselves (random weights): save it, draw
token ids, and transformers' own logits for them."""

from __future__ import annotations

import numpy as np
import torch


def checkpoint(model, tmp_path_factory, name: str):
    """(model in eval mode, the directory `save_pretrained` wrote it to)."""
    path = str(tmp_path_factory.mktemp(name))
    model.save_pretrained(path)
    return model.eval(), path


def token_ids(vocab_size: int, batch: int, seq: int, seed: int) -> np.ndarray:
    """[batch, seq] token ids in 0..vocab_size-1 from a seeded generator."""
    return np.random.default_rng(seed).integers(0, vocab_size, (batch, seq))


def reference_logits(model, tokens) -> np.ndarray:
    """transformers' float32 logits of `tokens` (one full forward, no cache)."""
    with torch.no_grad():
        return model(torch.tensor(tokens), use_cache=False).logits.float().numpy()
