"""Row invariance of the running backend's plain matrix product, proved per shape by a probe (`kernel=probed:T`).

Batch invariance asks that a row's product has the same bits whatever rows are multiplied beside it. `tiled:T`
buys it unconditionally: every row goes through one fixed [T, K] kernel, one small product per tile. Often the
backend's own product already has the property for a shape -- XLA:CPU's GEMM keeps each row's reduction order
whatever the row count, except on its matrix-vector path (one row) and where it splits the contraction -- but
whether it does depends on the backend, the library under it, the instruction set, the thread count and the
shape. So `probed:T` asks the backend, per product shape, instead of paying for the tiles everywhere:

- Rows are padded up to a **bucket** (`BUCKETS`: 8..64 in steps of 8, then 2^i and 3 * 2^(i-1) up to
  `max_rows(K)`), so only bucket-sized products ever run (never the one-row matrix-vector path).
- The **probe** (`prove`) multiplies random rows at every bucket size and at the largest, and proves the shape
  when every bucket's rows equal the largest's rows bit for bit, and a row's bits do not move when the other rows
  change. It calls the very product the model runs (`numerics.matmul._dot` under the policy), on this process's
  backend, instruction set and threads.
- The choice and its **evidence** (`Evidence`: shape, dtypes, buckets probed, the first bucket that differed,
  the environment) are recorded while programs are traced (`kernels.recording`, printed by `jaxalign check`),
  kept per process and on disk (`cache_path`: one file per environment -- backend, device, jax/jaxlib versions,
  instruction set, XLA_FLAGS, threads -- so a change of any of them probes again).
- A shape that is not proven, rows beyond the largest bucket (in whole largest-bucket chunks), a device mesh or
  a backend this module does not probe (only the CPU is probed here) keep the `tiled:T` tiles.

The proof is all or nothing per shape: every bucket is probed before any runs, because a shape whose small
buckets fell back to tiles while its large ones ran plain would give a row other bits in the engine's decode than
in the trainer's batch. Trainer and engine make the same choice for the same (K, N, dtypes, policy): the choice never depends on the row
count, so a row's bits are the same in the trainer's [B * S, K] product and the engine's decode product.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
from typing import Callable

import jax
import jaxlib
import jax.numpy as jnp
import numpy as np

PROBE_BYTES = 1 << 26  # the largest probed operand: 64 MiB
PROBED_PLATFORMS = ("cpu",)


def _buckets(limit: int) -> tuple[int, ...]:
    sizes = set(range(8, 65, 8))
    for i in range(6, 31):
        sizes.update((2 ** i, 3 * 2 ** (i - 1)))
    return tuple(sorted(s for s in sizes if s <= limit))


BUCKETS = _buckets(1 << 16)


def max_rows(k: int, itemsize: int = 4) -> int:
    """The largest bucket probed for a contraction of `k`: its operand stays within PROBE_BYTES."""
    fitting = [b for b in BUCKETS if b * k * itemsize <= PROBE_BYTES]
    return fitting[-1] if fitting else BUCKETS[0]


def bucket(rows: int, k: int, itemsize: int = 4) -> int:
    """The bucket `rows` rows are padded to (rows <= max_rows(k)); ValueError beyond it."""
    for b in BUCKETS:
        if b >= rows and b <= max_rows(k, itemsize):
            return b
    raise ValueError(f"{rows} rows exceed the largest probed bucket {max_rows(k, itemsize)} for K={k}; allowed: "
                     f"rows <= that (larger products run in whole chunks of it)")


def environment() -> dict:
    """What a proof holds for: backend, device kind, jax and jaxlib versions, the instruction set XLA:CPU targets,
    XLA_FLAGS and the threads this process may run on."""
    device = jax.devices()[0]
    try:
        threads = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        threads = os.cpu_count() or 1
    return {"backend": device.platform, "device": device.device_kind, "jax": jax.__version__,
            "jaxlib": jaxlib.__version__,
            "isa": _isa(os.environ.get("XLA_FLAGS", "")) if device.platform == "cpu" else None,
            "xla_flags": os.environ.get("XLA_FLAGS", ""), "threads": threads}


@functools.lru_cache(maxsize=16)
def _isa(xla_flags: str) -> str:
    """The instruction set XLA:CPU targets under these flags (read once per flags value, not once per product)."""
    from jaxalign.numerics.platforms import effective_isa

    return effective_isa(xla_flags)


@dataclasses.dataclass(frozen=True)
class Evidence:
    """What a probe found for one product shape: `proven` (every bucket's rows equal the largest bucket's bit for
    bit, and a row's bits independent of the other rows), the buckets probed and the first that differed."""

    k: int
    n: int
    dtype: str
    weight_dtype: str
    policy_key: str
    proven: bool
    buckets: tuple[int, ...]
    first_difference: int | None = None
    reason: str = ""

    def __str__(self) -> str:
        shape = f"[M, {self.k}] x [{self.k}, {self.n}] {self.dtype}"
        if self.proven:
            return (f"{shape}: plain product row-invariant over {len(self.buckets)} buckets "
                    f"{self.buckets[0]}..{self.buckets[-1]} rows (probed)")
        return f"{shape}: tiles ({self.reason})"

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {**dataclasses.asdict(self), "buckets": list(self.buckets)}


def prove(product: Callable[[jax.Array], jax.Array], k: int, dtype, *, buckets: tuple[int, ...],
          seed: int = 0) -> tuple[bool, int | None, str]:
    """(proven, first differing bucket, reason) for `product` ([M, k] rows -> [M, N]) over `buckets`: the rows
    of every bucket-sized product must equal the same rows of the largest bucket's product bit for bit, and the
    first rows of the largest product must keep their bits when every other row is replaced."""
    rng = np.random.default_rng(seed)
    largest, smallest = max(buckets), min(buckets)
    with jax.ensure_compile_time_eval():
        x = jnp.asarray(rng.standard_normal((largest, k)), jnp.float32).astype(dtype)
        full = _bits(product(x))
        products = {b: _bits(product(x[:b])) for b in sorted(buckets)}
        # the first bucket whose first rows leave the smallest bucket's bits names where the kernel changes
        for b, got in products.items():
            if not np.array_equal(got[:smallest], products[smallest]):
                return False, b, (f"the first {smallest} rows of a {b}-row product differ from those of a "
                                  f"{smallest}-row one")
        for b, got in products.items():
            if not np.array_equal(got, full[:b]):
                return False, b, f"rows of a {b}-row product differ from the same rows of a {largest}-row one"
        other = jnp.asarray(rng.standard_normal((largest, k)), jnp.float32).astype(dtype).at[:8].set(x[:8])
        if not np.array_equal(_bits(product(other))[:8], full[:8]):
            return False, largest, "a row's bits move when the other rows change"
    return True, None, ""


def _bits(values: jax.Array) -> np.ndarray:
    return np.asarray(jax.device_get(values)).view(np.uint8)


_proofs: dict[tuple, Evidence] = {}


def cache_path(env: dict | None = None) -> str:
    """The file holding this environment's proofs: $JAXALIGN_CACHE_DIR (default ~/.cache/jaxalign) /
    invariance-<hash of the environment>.json."""
    env = environment() if env is None else env
    root = os.environ.get("JAXALIGN_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "jaxalign")
    digest = hashlib.sha256(json.dumps(env, sort_keys=True).encode()).hexdigest()[:16]
    return os.path.join(root, f"invariance-{digest}.json")


def _disk_key(key: tuple) -> str:
    return json.dumps(list(key))


def _read_disk(path: str) -> dict:
    try:
        with open(path) as f:
            data = json.load(f)
        return data.get("proofs", {}) if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}  # missing or unreadable: probe again (a proof is cheap to redo, never trusted half-written)


def _write_disk(path: str, env: dict, proofs: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump({"environment": env, "proofs": proofs}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)  # atomic: a reader sees the old file or the new one


def evidence(k: int, n: int, dtype, weight_dtype, policy_key: str,
             product_of: Callable[[jax.Array], Callable[[jax.Array], jax.Array]], platform: str, *,
             prover=prove) -> Evidence:
    """The evidence for a [M, k] x [k, n] product (`product_of(w)` -> the rows' product by the weight `w`), from
    this process's proofs, the environment's file, or a fresh probe (then recorded in both). Platforms not in
    PROBED_PLATFORMS get tiles without a probe."""
    dtype, weight_dtype = jnp.dtype(dtype).name, jnp.dtype(weight_dtype).name
    buckets = tuple(b for b in BUCKETS if b <= max_rows(k))
    if platform not in PROBED_PLATFORMS:
        return Evidence(k, n, dtype, weight_dtype, policy_key, False, buckets,
                        reason=f"backend {platform} is not probed here")
    env = environment()
    key = (k, n, dtype, weight_dtype, policy_key, prover.__module__ + "." + prover.__qualname__)
    env_key = (key, json.dumps(env, sort_keys=True))
    if env_key in _proofs:
        return _proofs[env_key]
    path = cache_path(env)
    stored = _read_disk(path)
    found = stored.get(_disk_key(key))
    if found is not None:
        proof = Evidence(**{**found, "buckets": tuple(found["buckets"])})
    else:
        rng = np.random.default_rng(1)
        with jax.ensure_compile_time_eval():
            w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32).astype(weight_dtype)
        proven, first, reason = prover(jax.jit(product_of(w)), k, dtype, buckets=buckets)
        proof = Evidence(k, n, dtype, weight_dtype, policy_key, proven, buckets, first, reason)
        stored = _read_disk(path)  # another process may have written meanwhile
        stored[_disk_key(key)] = proof.to_dict()
        try:
            _write_disk(path, env, stored)
        except OSError:
            pass  # a read-only cache: the proof still holds for this process
    _proofs[env_key] = proof
    return proof


def forget() -> None:
    """Drop this process's proofs (the environment's file stays): the next product probes or reads the file."""
    _proofs.clear()
