"""The layer-kind contract (`LayerKind`) and the mixer call every kind's module answers.

The mixer sits in a block's `attn` slot (pre-norm residual: `x + mixer(norm(x))`, then the MLP) and is called as

    out, state, selection = mixer(x, positions, policy, state=None, *, valid=None, index_replay=None)

- `x` [B, S, D] in the compute dtype, `positions` [B, S] int32 (a row's positions are consecutive in a call);
- `state`: None in the trainer's full forward (the sequence starts at position 0 from an empty state); in the
  engine, this layer's state from `init_state` / the previous call (the engine never looks inside it);
- `valid` [B, S] bool or None (= all True): which entries are real tokens. The engine passes it for every call:
  prompt padding (prompts are right-padded to a bucket), rows of a static batch that have finished, and idle
  continuous-batching slots are False. In one call a row's valid entries are a prefix of its S entries (possibly
  none). A kind whose state summarises the past (a recurrent or conv state) must leave the state of a row
  unchanged at its invalid entries; attention caches may ignore `valid` (a key written at slot = position is
  only ever read by queries at later positions of the same row, and rewritten before that if it was a pad);
- `index_replay` [B, S, index_topk] (kinds whose `index_topk(cfg)` > 0, else ignored): recorded key (or
  compressed entry) positions;
- returns the output [B, S, D], the new state (None when `state` was None) and a selection (an indexer's
  (positions [B, S, index_topk], margins [B, S]): DSA's, DeepSeek-V4's CSA; None for kinds without one).

Continuous batching refills a slot with a new request: before the slot's first token the engine calls
`reset_state(cfg, state, rows)` with `rows` [B] bool marking the refilled slots, so a request never sees its
predecessor's state.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

MixerOutput = tuple[jax.Array, Any, Any]  # (out [B, S, D], new state or None, selection or None)
# take(name, shape) -> np.ndarray: a transformers tensor by name, shape-checked (interop.hf's reader)
Take = Callable[[str, tuple[int, ...]], np.ndarray]


class LayerKind:
    """One layer kind. Subclasses set `name` and `fields` and implement `build`, `init_state`, `hf_params` and
    `hf_tensors`; the rest have defaults. Methods take the ModelConfig, so a kind is a stateless singleton in
    the registry (`jaxalign.model.kinds.register`)."""

    name: str = ""
    # the ModelConfig fields this kind owns: validated by `validate`, left out of `ModelConfig.to_dict` (and so of
    # its fingerprint) when no layer runs the kind
    fields: tuple[str, ...] = ()
    lora_names: tuple[str, ...] = ()  # every Linear name `lora_targets` may return (what add_lora accepts)

    def validate(self, cfg) -> None:
        """Raise ValueError naming the field and what is allowed when `cfg` cannot run this kind."""

    def build(self, cfg, layer: int, *, rngs):
        """The mixer module (an nnx.Module answering the call above) for layer `layer`."""
        raise NotImplementedError

    def index_topk(self, cfg) -> int:
        """How many keys or entries this kind's indexer selects for each query (the last axis of its selection and
        of `index_replay`); 0 (the default): the kind selects nothing, returns no selection and ignores
        `index_replay`. The routing record holds one selection per layer whose kind says > 0
        (`model/routing.py:index_layers`)."""
        return 0

    def form(self, policy) -> str:
        """The form `policy` selects for this kind (e.g. MLA's expanded or absorbed), for reports."""
        return "default"

    # --- engine state ---------------------------------------------------------------------------------------
    def init_state(self, cfg, batch: int, cache_len: int, policy) -> Any:
        """One layer's empty state for `batch` rows of up to `cache_len` positions, in the dtypes `policy`
        names."""
        raise NotImplementedError

    def reset_state(self, cfg, state, rows: jax.Array) -> Any:
        """`state` with the rows marked in `rows` [B] bool back to the empty state (by default: zeros, every
        leaf's first axis being the batch)."""
        def zero(leaf):
            mask = rows.reshape((-1,) + (1,) * (leaf.ndim - 1))
            return jnp.where(mask, jnp.zeros((), leaf.dtype), leaf)
        return jax.tree.map(zero, state)

    def state_bytes(self, cfg, batch: int, cache_len: int, policy) -> int:
        """Bytes of one layer's state (by default: measured on `init_state`'s shapes)."""
        shapes = jax.eval_shape(lambda: self.init_state(cfg, batch, cache_len, policy))
        return int(sum(np.prod(s.shape) * jnp.dtype(s.dtype).itemsize for s in jax.tree.leaves(shapes)))

    # --- transformers config ---------------------------------------------------------------------------------------
    def config_from_hf(self, hf: dict, common: dict) -> dict:
        """The ModelConfig fields this kind reads from a transformers config.json dict (`common`: the fields the
        family read already); a feature the kind does not implement is refused by name (ValueError)."""
        return {}

    def config_to_hf(self, cfg) -> dict:
        """The config.json fields of this kind for `cfg` (inverse of `config_from_hf`)."""
        return {}

    # --- training, interop, checks ------------------------------------------------------------------------------
    def lora_targets(self, cfg) -> tuple[str, ...]:
        """Names of the mixer's Linear layers `add_lora` adapts by default."""
        return ()

    def hf_params(self, cfg, take: Take, prefix: str) -> dict:
        """The mixer's parameter tree (numpy, jaxalign layout) from transformers tensors; `prefix` is the
        layer's (`model.layers.{i}.`)."""
        raise NotImplementedError

    def hf_tensors(self, cfg, params: dict, prefix: str) -> dict[str, np.ndarray]:
        """Inverse of `hf_params`: transformers tensor name -> array."""
        raise NotImplementedError

    def probes(self, cfg, policy, rng: np.random.Generator, q_len: int, k_len: int) -> dict[str, tuple]:
        """Kernel probes for `jaxalign check`: name -> (make(b, seed) -> rows [b, n], fn(rows) -> [b, ...]), the
        kernel as the model calls it on `q_len` queries over `k_len` positions."""
        return {}


def split_rows(x: jax.Array, shapes: tuple[tuple[int, ...], ...]) -> list[jax.Array]:
    """Rows x [B, sum of sizes] cut into one [B, *shape] piece per shape (a probe row holds every operand)."""
    sizes = [int(np.prod(shape)) for shape in shapes]
    pieces = jnp.split(x, np.cumsum(sizes)[:-1].tolist(), axis=1)
    return [piece.reshape(x.shape[0], *shape) for piece, shape in zip(pieces, shapes)]


def rows_width(shapes: tuple[tuple[int, ...], ...]) -> int:
    """The width of a probe row holding one operand of each shape (what `split_rows` cuts it back into)."""
    return sum(int(np.prod(shape)) for shape in shapes)


def random_rows(n: int) -> Callable:
    """make(b, seed) for a probe: [b, n] standard normal float32 rows."""
    return lambda b, seed: jnp.asarray(np.random.default_rng(seed).normal(0, 1, (b, n)), jnp.float32)


def hf_linear(take: Take, name: str, d_in: int, d_out: int, bias: bool) -> dict:
    """A transformers Linear (`name.weight` [out, in], optional `name.bias`) as jaxalign's {"w": [in, out], "b"}."""
    out = {"w": take(name + ".weight", (d_out, d_in)).T}
    if bias:
        out["b"] = take(name + ".bias", (d_out,))
    return out


def hf_field(hf: dict, *names):
    """The first of several spellings transformers uses for one field (e.g. num_experts / num_local_experts)."""
    for name in names:
        if hf.get(name) is not None:
            return hf[name]
    raise ValueError(f"config.json has no value for {' / '.join(names)} (required for model_type "
                     f"{hf.get('model_type')!r})")
