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


def transformers_cached_logits(model, tokens, prefill: int) -> np.ndarray:
    """transformers' logits decoding `tokens` with its cache: a prefill of `prefill` tokens, then one token at a
    time; [batch, seq - prefill, vocab] for positions prefill - 1 .. seq - 2."""
    with torch.no_grad():
        out = model(torch.tensor(tokens[:, :prefill]), use_cache=True)
        cache, steps = out.past_key_values, [out.logits[:, -1].float().numpy()]
        for t in range(prefill, tokens.shape[1] - 1):
            out = model(torch.tensor(tokens[:, t:t + 1]), past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            steps.append(out.logits[:, -1].float().numpy())
    return np.stack(steps, 1)


def our_cached_logits(model, tokens, policy, steps: int) -> np.ndarray:
    """The project's logits decoding the first `steps` of `tokens` one token at a time through each layer kind's
    engine state (the forward's `kv`), under `policy`: [batch, steps, vocab]."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxalign.model import kinds
    cfg, (batch, seq) = model.config, tokens.shape
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, tokens, positions, kv):
        return nnx.merge(graphdef, state).forward(tokens, policy, positions=positions, kv=kv)[::2]

    kv = [kinds.kind_of(cfg, i).init_state(cfg, batch, seq, policy) for i in range(cfg.n_layers)]
    out = []
    for t in range(steps):
        logits, kv = step(state, jnp.asarray(tokens[:, t:t + 1]), jnp.full((batch, 1), t, jnp.int32), kv)
        out.append(np.asarray(logits))
    return np.concatenate(out, 1)


def export_round_trip(path: str, out: str):
    """Load the checkpoint at `path` with `interop.hf`, write it back to `out`, and read both safetensors files:
    (our model, the tensors transformers saved, the tensors we wrote), after checking the names are the same."""
    import os

    from safetensors.numpy import load_file

    from jaxalign.interop import hf
    ours = hf.load(path)
    hf.save(ours, out)
    theirs = load_file(os.path.join(path, "model.safetensors"))
    written = load_file(os.path.join(out, "model.safetensors"))
    assert set(written) == set(theirs)
    return ours, theirs, written
