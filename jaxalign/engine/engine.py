"""The rollout engine: holds its own copy of the weights (cast once to the policy's parameter dtype, as an
engine receives a weight update) and generates with the compiled programs in `kernels`."""

from __future__ import annotations

import functools
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxalign.engine import kernels
from jaxalign.engine.rollout import Rollout
from jaxalign.model.sharding import mesh_context, mesh_description, put_batch, shard_state, to_host
from jaxalign.model.transformer import Transformer
from jaxalign.numerics import NumericPolicy, cast_params
from jaxalign.numerics.sampling import SamplingParams

SCHEDULES = ("static", "continuous")
_BUCKET = 8


@functools.partial(jax.jit, static_argnames=("policy",))
def cast_state(state, policy):
    """The engine's copy of the model state: parameters cast as `policy` stores them for serving."""
    return cast_params(state, policy)


def check_prompts(prompts, vocab_size: int, max_new_tokens: int, max_len: int | None = None,
                  limit: str = "the engine's maximum length") -> list[np.ndarray]:
    """Prompts as int32 arrays, checked: a non-empty list of non-empty 1-D integer ids in 0..vocab_size-1, and
    (with `max_len`) prompt + max_new_tokens within it (`limit` names that bound in the error). A ValueError naming
    the prompt and what is allowed otherwise. Every engine checks its prompts with this."""
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
        prompts = list(prompts)
    if not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id sequences")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens = {max_new_tokens!r}; allowed: an int >= 1")
    out = []
    for i, prompt in enumerate(prompts):
        arr = np.asarray(prompt)
        if arr.ndim != 1 or arr.size == 0:
            raise ValueError(f"prompt {i} is empty or not 1-D (shape {arr.shape}); every prompt needs >= 1 token")
        if not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"prompt {i} holds {arr.dtype}, not integer token ids")
        if arr.min() < 0 or arr.max() >= vocab_size:
            raise ValueError(f"prompt {i} holds ids in [{arr.min()}, {arr.max()}]; allowed: 0..{vocab_size - 1}")
        if max_len is not None and arr.size + max_new_tokens > max_len:
            raise ValueError(f"prompt {i} has {arr.size} tokens + max_new_tokens {max_new_tokens} > {limit}")
        out.append(arr.astype(np.int32))
    return out


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class Engine:
    """A generation engine for one model structure under one NumericPolicy.

    `Engine(model, policy)` casts the model's f32 master weights to `policy.param_dtype` once;
    `sync_weights(model)` does it again after a training step. `generate(...)` never casts weights.
    With a `mesh` (`jaxalign.make_mesh`), weights and KV cache are split over it as `model/sharding.py` says
    and every program runs on it.
    """

    def __init__(self, model: Transformer, policy: NumericPolicy, mesh: jax.sharding.Mesh | None = None):
        if not isinstance(policy, NumericPolicy):
            raise ValueError(f"policy must be a NumericPolicy, got {type(policy).__name__}")
        self.policy = policy
        self.mesh = mesh
        self.config = model.config
        self.graphdef, _ = nnx.split(model)
        self.state = None
        self.compiles = 0  # engine programs this engine's calls traced (compiled); see Rollout.stats["compiles"]
        self.sync_weights(model)

    def sync_weights(self, model: Transformer) -> None:
        """Receive new weights: cast the model's parameters to the engine's parameter dtype (once); under a
        `lora=merged` policy, LoRA adapters are folded into the weights here, not per step."""
        from jaxalign.model.lora import has_lora, merge_lora_for_serving
        if model.config != self.config:
            raise ValueError("sync_weights got a model with another config than this engine was built for")
        graphdef, state = nnx.split(model)
        if not all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(state)):
            state = jax.tree.map(to_host, state)  # weights from a multi-process trainer mesh
        if self.policy.lora == "merged" and has_lora(model):
            state = jax.tree.map(lambda x: x, state)  # fresh variables: the caller's model stays untouched
            copy = nnx.merge(graphdef, state)
            merge_lora_for_serving(copy, self.policy)
            _, state = nnx.split(copy)
        self.graphdef = graphdef
        with mesh_context(self.mesh):
            self.state = cast_state(shard_state(state, self.mesh), self.policy)

    def _check(self, prompts, max_new_tokens, eos_id, batch_size, schedule,
               prefill_chunk) -> list[np.ndarray]:
        cfg = self.config
        checked = check_prompts(prompts, cfg.vocab_size, max_new_tokens, cfg.max_seq_len,
                                f"the cache (max_seq_len = {cfg.max_seq_len})")
        if eos_id is not None and not 0 <= eos_id < cfg.vocab_size:
            raise ValueError(f"eos_id = {eos_id}; allowed: None or 0..{cfg.vocab_size - 1}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule = {schedule!r}; allowed: {', '.join(SCHEDULES)}")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size = {batch_size!r}; allowed: None or an int >= 1")
        if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk < 1):
            raise ValueError(f"prefill_chunk = {prefill_chunk!r}; allowed: None or an int >= 1")
        if prefill_chunk is not None and schedule == "continuous":
            raise ValueError("prefill_chunk applies to the static schedule; continuous batching prefills one "
                             "token per slot per step")
        return checked

    def generate(self, prompts, *, max_new_tokens: int, sampling: SamplingParams | None = None,
                 temperature: float | None = None, top_k: int | None = None,
                 top_p: float | None = None, eos_id: int | None = None, seed: int = 0,
                 batch_size: int | None = None, schedule: str = "static",
                 prefill_chunk: int | None = None, request_ids=None) -> Rollout:
        """Generate a completion for every prompt; see `jaxalign.generate`."""
        sampling = SamplingParams.from_args(sampling, temperature, top_k, top_p)
        prompts = self._check(prompts, max_new_tokens, eos_id, batch_size, schedule,
                              prefill_chunk)
        n = len(prompts)
        ids = np.arange(n, dtype=np.int32) if request_ids is None else np.asarray(request_ids)
        if ids.shape != (n,) or not np.issubdtype(ids.dtype, np.integer) or (n and ids.min() < 0):
            raise ValueError(f"request_ids must be {n} non-negative ints (one per prompt), got {request_ids!r}")
        ids = ids.astype(np.int32)
        lens = np.array([len(p) for p in prompts], np.int32)
        p_max = _round_up(int(lens.max()), _BUCKET)
        cache_len = _round_up(p_max + max_new_tokens, _BUCKET)
        padded = np.zeros((n, p_max), np.int32)
        for i, prompt in enumerate(prompts):
            padded[i, : len(prompt)] = prompt
        static = dict(policy=self.policy, cache_len=cache_len, sampling=sampling)
        stops = (jnp.int32(max_new_tokens), jnp.int32(-1 if eos_id is None else eos_id))  # traced: shared programs
        traces_before = kernels.traces_in_this_thread()
        start = time.perf_counter()
        put = functools.partial(put_batch, mesh=self.mesh)
        seq_len = p_max + max_new_tokens
        tokens = np.zeros((n, seq_len), np.int32)
        step_lp = np.zeros((n, seq_len), np.float32)  # entry p: logprob of the token at position p
        n_gen = np.zeros(n, np.int32)
        routing = None  # the RoutingRecord [n, seq_len, ...], filled batch by batch
        slots = batch_size or n
        if schedule == "static":
            for first in range(0, n, slots):
                rows = np.arange(first, min(first + slots, n))
                pick = np.concatenate([rows, np.full(slots - len(rows), rows[0])])  # pad the last batch
                with mesh_context(self.mesh):
                    out_tok, out_lp, gen, record = kernels.run_static(
                        self.graphdef, self.state, put(padded[pick]), put(lens[pick]), put(ids[pick]),
                        jnp.int32(seed), *stops, prefill_chunk=prefill_chunk, **static)
                out_tok, out_lp, gen = to_host(out_tok), to_host(out_lp), to_host(gen)
                k = len(rows)
                for j, i in enumerate(rows):
                    tokens[i, : lens[i]] = prompts[i]
                    tokens[i, lens[i]: lens[i] + gen[j]] = out_tok[j, : gen[j]]
                    step_lp[i, lens[i]: lens[i] + gen[j]] = out_lp[j, : gen[j]]
                n_gen[rows] = gen[:k]
                part = jax.tree.map(lambda a: to_host(a)[:k, :seq_len], record)
                if routing is None:
                    routing = jax.tree.map(lambda a: np.zeros((n,) + a.shape[1:], a.dtype), part)
                for dst, src in zip(jax.tree.leaves(routing), jax.tree.leaves(part)):
                    dst[rows] = src
        else:
            with mesh_context(self.mesh):
                tok_buf, lp_buf, gen, record = kernels.run_continuous(
                    self.graphdef, self.state, put(padded), put(lens), put(ids), jnp.int32(seed), *stops,
                    slots=slots, **static)
            tokens[:] = to_host(tok_buf)[:, :seq_len]
            step_lp[:] = to_host(lp_buf)[:, :seq_len]
            n_gen[:] = to_host(gen)
            routing = jax.tree.map(lambda a: to_host(a)[:, :seq_len], record)
        elapsed = time.perf_counter() - start
        compiled = kernels.traces_in_this_thread() - traces_before
        self.compiles += compiled
        pos = np.arange(seq_len)[None, :]
        in_completion = (pos >= lens[:, None]) & (pos < (lens + n_gen)[:, None])
        tokens = np.where(pos < (lens + n_gen)[:, None], tokens, 0).astype(np.int32)
        last = tokens[np.arange(n), lens + n_gen - 1]
        reasons = ["eos" if eos_id is not None and last[i] == eos_id else "length" for i in range(n)]
        return Rollout(
            tokens=tokens, logprobs=np.where(in_completion, step_lp, 0.0)[:, 1:].astype(np.float32),
            mask=in_completion[:, 1:], prompt_lens=lens, completion_lens=n_gen, finish_reasons=reasons,
            routing=routing, sampling=sampling,
            stats={"schedule": schedule, "batch_size": slots, "policy": str(self.policy), "seconds": elapsed,
                   "mesh": mesh_description(self.mesh),
                   "new_tokens": int(n_gen.sum()), "compiles": compiled,
                   "cache_len": cache_len, "kv_cache_bytes": self.kv_cache_bytes(slots, cache_len)})

    def kv_cache_bytes(self, batch: int, cache_len: int) -> int:
        """Bytes of the engine state (every layer's, by its kind: per-head keys and values for GQA, the latent
        and rope key for MLA) for `batch` rows of `cache_len` slots under this policy."""
        return kernels.state_bytes(self.config, batch, cache_len, self.policy)


def generate(model: Transformer, prompts, policy: NumericPolicy, *, max_new_tokens: int,
             sampling: SamplingParams | None = None, temperature: float | None = None,
             top_k: int | None = None, top_p: float | None = None, eos_id: int | None = None, seed: int = 0,
             batch_size: int | None = None, schedule: str = "static",
             prefill_chunk: int | None = None, request_ids=None, mesh: jax.sharding.Mesh | None = None) -> Rollout:
    """Generate completions for `prompts` (a list of token-id sequences) under an engine `policy`.

    `sampling` (a `SamplingParams`; or its shorthand `temperature`/`top_k`/`top_p`, default temperature 1)
    names the distribution; `temperature=0` is greedy. It is stored in `Rollout.sampling`, and scoring the rollout
    reads it from there. `schedule="static"` runs requests in batches of `batch_size` (default: all at
    once); `"continuous"` keeps `batch_size` slots busy, refilling a finished slot with the next request.
    `prefill_chunk` prefills static batches C tokens at a time. Returns a `Rollout` with the engine's logprob of
    every sampled token (see `jaxalign.numerics.sampling` for what that logprob means) and the routing record.
    Random draws are keyed by (seed, request id, position); `request_ids` (default 0..n-1) names the requests,
    so one request draws the same tokens whatever batch or slot it runs in. `mesh`: run sharded on it.
    """
    return Engine(model, policy, mesh).generate(
        prompts, max_new_tokens=max_new_tokens, sampling=sampling, temperature=temperature, top_k=top_k, top_p=top_p,
        eos_id=eos_id,
        seed=seed, batch_size=batch_size, schedule=schedule, prefill_chunk=prefill_chunk, request_ids=request_ids)
