"""Helpers shared by the benchmark scripts: the machine record, thread pinning, timing, side processes, JSON.

Fairness rules every script follows (docs/performance.md):
- both sides run on the same CPU set, with their thread counts pinned and printed (`pin_threads`);
- each side that is compared with another library runs in its own process (`Side`), so its peak memory is
  its own; the parent asks the sides for one timed repetition at a time, in rotating order, so a burst of load
  on this shared machine hits every side alike, and reports each side's best repetition;
- the first call (compilation, caches) is timed apart from the steady-state repetitions;
- every result file records the machine, the load average at start and end, and the thread settings.
"""

from __future__ import annotations

import json
import os
import platform
import resource
import subprocess
import sys
import time

_LOAD_AT_START = os.getloadavg()
_ISA_FLAGS = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "amx_bf16",
              "amx_tile")
_REPLY = "@@bench-reply "


def pin_threads(threads: int | None = None) -> int:
    """Pin this process to the first `threads` CPUs of the set it was started with (all of them by default)
    and size every thread pool to that count; returns the count.

    XLA:CPU sizes its intra-op pool from the process's CPU affinity (tsl MaxParallelism), so pinning the
    affinity before jax is imported pins jax; torch is set explicitly. Call before importing jax or torch.
    """
    cores = sorted(os.sched_getaffinity(0))
    if threads is not None:
        if not 1 <= threads <= len(cores):
            raise ValueError(f"threads = {threads}; allowed: 1..{len(cores)} (this process's CPUs: {cores})")
        cores = cores[:threads]
    os.sched_setaffinity(0, cores)
    n = len(cores)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(n)
    return n


def thread_settings() -> dict:
    """The thread counts this process runs with (read back, not assumed)."""
    out = {"cpu_affinity": sorted(os.sched_getaffinity(0)), "xla_flags": os.environ.get("XLA_FLAGS", ""),
           "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}
    if "jax" in sys.modules:
        out["jax_intra_op_threads"] = len(os.sched_getaffinity(0))  # XLA:CPU's pool follows the affinity
    if "torch" in sys.modules:
        torch = sys.modules["torch"]
        out["torch_num_threads"] = torch.get_num_threads()
        out["torch_num_interop_threads"] = torch.get_num_interop_threads()
    return out


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far (MiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def machine() -> dict:
    """Where the numbers were measured: CPU model, cores, ISA, load average now and at start, versions."""
    from jaxalign.numerics.platforms import cpu_model_and_flags
    model, flags = cpu_model_and_flags()
    versions = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "torch", "transformers", "numpy"):
        mod = sys.modules.get(name)
        if mod is not None:
            versions[name] = getattr(mod, "__version__", "?")
    return {"platform": platform.platform(), "cpu_model": model, "cpu_count": os.cpu_count(),
            "isa": [f for f in _ISA_FLAGS if f in flags], "load_average_start": list(_LOAD_AT_START),
            "load_average_end": list(os.getloadavg()), "versions": versions, "threads": thread_settings()}


def machine_line(m: dict) -> str:
    """One printable line of `machine()`."""
    return (f"machine: {m['cpu_model']}, {m['cpu_count']} cores, ISA {'/'.join(m['isa'])}; load average "
            f"{m['load_average_start'][0]:.2f} at start, {m['load_average_end'][0]:.2f} at end")


def write_json(path: str, payload: dict) -> dict:
    """Write a result file (creating its folder) with the machine record; returns the record written."""
    record = {"machine": machine(), **payload}
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(record, f, indent=2)
    print(machine_line(record["machine"]))
    print(f"wrote {path}")
    return record


def block(x):
    """Wait for jax arrays in `x` (if jax is loaded); returns `x`."""
    if "jax" in sys.modules:
        sys.modules["jax"].block_until_ready(x)
    return x


def timed(fn) -> tuple[float, object]:
    """(wall seconds, result) of one call of `fn`, waiting for jax results."""
    start = time.perf_counter()
    out = block(fn())
    return time.perf_counter() - start, out


def interleaved_best(runners: dict, repeats: int, pause_s: float = 0.2) -> dict:
    """Best seconds of each runner (name -> zero-argument callable returning seconds) over `repeats` rounds;
    each round calls every runner once, starting one further along each round. The pause before each call
    lets the previous runner's worker threads (OpenMP spin-waits) go idle so they do not steal the next one's
    cores."""
    names = list(runners)
    best = {name: float("inf") for name in names}
    for r in range(repeats):
        for name in names[r % len(names):] + names[: r % len(names)]:
            time.sleep(pause_s)
            best[name] = min(best[name], runners[name]())
    return best


# --- side processes --------------------------------------------------------------------------------------------
class Side:
    """A benchmark side in its own process: `python SCRIPT --side SPEC`, answering JSON requests line by line.

    The side's own prints go to stderr; replies are single stdout lines led by a marker.
    """

    def __init__(self, script: str, spec: str, *extra: str):
        self.spec = spec
        self.proc = subprocess.Popen([sys.executable, script, "--side", spec, *extra], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, bufsize=1)

    def call(self, op: str, **kwargs):
        """Send one request and return the side's reply (raises if the side failed)."""
        self.proc.stdin.write(json.dumps({"op": op, **kwargs}) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(_REPLY):
                reply = json.loads(line[len(_REPLY):])
                if "error" in reply:
                    raise RuntimeError(f"side {self.spec!r} failed on {op!r}: {reply['error']}")
                return reply["result"]
        raise RuntimeError(f"side {self.spec!r} exited (code {self.proc.wait()}) during {op!r}")

    def close(self) -> None:
        """Ask the side to exit and wait for it."""
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=60)


def serve(handlers: dict) -> None:
    """Side-process main loop: read JSON requests from stdin, reply through stdout; prints go to stderr."""
    out = sys.stdout
    sys.stdout = sys.stderr
    for line in sys.stdin:
        request = json.loads(line)
        try:
            result = handlers[request.pop("op")](**request)
            reply = {"result": result}
        except Exception as exc:  # reported to the parent, which raises
            import traceback
            traceback.print_exc()
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        out.write(_REPLY + json.dumps(reply) + "\n")
        out.flush()


def trainer_step_fn(model, policy):
    """A jitted forward+backward (value_and_grad of the mean next-token logprob) under `policy`, and its params."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxalign import sequence_logprobs

    graphdef, params = nnx.split(model)

    @jax.jit
    def step(params, tokens):
        def loss(p):
            lp, _ = sequence_logprobs(nnx.merge(graphdef, p), tokens, policy)
            return -jnp.mean(lp)
        return jax.value_and_grad(loss)(params)

    return step, params
