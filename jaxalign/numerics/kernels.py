"""Which implementation runs a kernel, from the policy's semantics and the platform.

The policy states semantics; the platform decides how they are held:

| policy | cpu | gpu / tpu |
|---|---|---|
| `kernel=xla` | one XLA product | one XLA product |
| `kernel=tiled:T` | lax: rows padded to [T, K] tiles, one XLA dot per tile (`lax.map`) | the Pallas kernels, blocks derived from T (`derived_blocks`) |
| `kernel=pallas:BMxBNxBK` | the Pallas kernels in interpret mode, these blocks | the Pallas kernels compiled, these blocks |

The same holds for the sorted dispatch's grouped product and, with `attn=chunked:C`, for attention (under
`attn=full` attention is lax everywhere). Under a device mesh `tiled:T` stays lax on every platform (the Pallas
kernels are not partitioned) and `pallas:...` is refused. Only standard attention has a Pallas kernel: MLA and
DSA attention (other scale, narrower values, sparse keys) stay lax under `tiled:T` and are refused under
`pallas:...`. A platform other than cpu/gpu/tpu keeps the lax paths of `xla` and `tiled:T` and refuses
`pallas:...` (no Pallas lowering).

Block rule for `tiled:T` on a GPU (Triton): BM = T rounded up to a power of two >= 16, BN = BK = 64, each
lowered to the product's dimension rounded up to a power of two when that is smaller (never under 16), the
operands zero-padded to whole blocks (exact: zeros add zeros). On a TPU (Mosaic): BM = T rounded up to a multiple
of 8 (16 for 16-bit operands), BN = BK = 128, or the whole dimension when it is smaller. Attention takes BM from
the same rule (on a GPU, at least 16 / G so that the G heads of a kv head make a block of >= 16 rows). The rule
depends on T, the operand dtype and the product's K and N only -- never on the number of rows -- so a row's bits
stay independent of its batch, and trainer and engine (same weights, same shapes) run the same kernels.
Refused, naming the field, value, platform and what is allowed: a low-precision accumulation or a
dot-algorithm preset (`matmul_acc`, `matmul_bwd`) with `tiled:T` on a GPU/TPU (the kernels accumulate in float32
at HIGHEST precision), and attention blocks the platform cannot lower (`check_attention_blocks`).

The platform is an explicit argument of every `select_*` function (callers pass `platforms.platform()`), so
tests on the CPU can ask for the GPU or TPU choice. `recording()` collects, while functions are traced, the
implementation each kernel was given (`jaxalign check` reports them).
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxalign.numerics.collectives import mesh_active
from jaxalign.numerics.pallas_attention import check_attention_blocks
from jaxalign.numerics.pallas_matmul import _round_up, check_blocks
from jaxalign.numerics.platforms import PLATFORMS
from jaxalign.numerics.policy import NumericPolicy

LOWERINGS = {"cpu": "interpret mode", "gpu": "Triton", "tpu": "Mosaic"}
_recorders: list[set[str]] = []


@dataclasses.dataclass(frozen=True)
class Implementation:
    """What runs one kernel: `kind` is `xla`, `xla-bucketed` (`probed:T` where proven: a plain product on rows
    padded to a bucket, `evidence` the proof), `lax-tiled`, `lax-full`, `lax-chunked` or `pallas`; `blocks` the
    Pallas (BM, BN, BK) request (attention: BM only), `derived` whether they come from `tiled:T`."""

    kernel: str
    kind: str
    platform: str
    tile: int | None = None
    blocks: tuple[int, ...] | None = None
    derived: bool = False
    evidence: object = None  # numerics.invariance.Evidence under probed:T

    def __str__(self) -> str:
        if self.evidence is not None:
            return f"{self.kernel}: {self.kind}{f' T={self.tile}' if self.kind == 'lax-tiled' else ''} ({self.platform}; {self.evidence})"
        if self.kind == "pallas":
            shape = "x".join(str(b) for b in self.blocks)
            source = f" from tiled:{self.tile}" if self.derived else ""
            what = f"pallas BM={shape}" if len(self.blocks) == 1 else f"pallas {shape}"
            return f"{self.kernel}: {what}{source} ({self.platform}, {LOWERINGS[self.platform]})"
        detail = f" T={self.tile}" if self.kind == "lax-tiled" else ""
        return f"{self.kernel}: {self.kind}{detail} ({self.platform})"


@contextlib.contextmanager
def recording() -> Iterator[set[str]]:
    """Collect `str(Implementation)` of every kernel selected while functions are traced inside the block (a
    program JAX has already traced is not traced again, so its kernels are not seen)."""
    found: set[str] = set()
    _recorders.append(found)
    try:
        yield found
    finally:
        _recorders.remove(found)


def _chosen(impl: Implementation) -> Implementation:
    for found in _recorders:
        found.add(str(impl))
    return impl


def _check_platform(platform: str, policy: NumericPolicy) -> None:
    if platform not in PLATFORMS:
        raise ValueError(f"NumericPolicy.matmul_kernel = {policy.matmul_kernel!r}: backend {platform!r} has no "
                         f"Pallas lowering here; allowed backends: cpu (interpret mode), gpu (Triton), tpu "
                         f"(Mosaic); other backends run kernel=xla or tiled:T (lax)")


def derived_blocks(tile: int, operand_dtype, platform: str) -> tuple[int, int, int]:
    """The (BM, BN, BK) request `tiled:T` becomes on a GPU or TPU (see the module docstring)."""
    if platform == "gpu":
        return max(16, pl.next_power_of_2(tile)), 64, 64
    if platform == "tpu":
        return _round_up(tile, 16 if jnp.dtype(operand_dtype).itemsize == 2 else 8), 128, 128
    raise ValueError(f"derived_blocks: platform {platform!r} runs tiled:T on the lax path; allowed: gpu, tpu")


def _require_f32(policy: NumericPolicy, platform: str) -> None:
    for field, allowed in (("matmul_acc", ("f32",)), ("matmul_bwd", ("same", "f32"))):
        value = getattr(policy, field)
        if value not in allowed:
            raise ValueError(f"NumericPolicy.{field} = {value!r} with matmul_kernel = {policy.matmul_kernel!r} on "
                             f"backend {platform!r}: there tiled:T runs as Pallas kernels, which accumulate in "
                             f"float32 at HIGHEST precision; allowed: {field} {' or '.join(allowed)} (or "
                             f"matmul_kernel=xla)")


def _lax_tiled(policy: NumericPolicy, platform: str) -> bool:
    return platform not in ("gpu", "tpu") or mesh_active()


def select_matmul(policy: NumericPolicy, k: int, n: int, operand_dtype, platform: str, *,
                  kernel: str = "matmul", probe=None) -> Implementation:
    """The implementation of a [rows, k] x [k, n] product (`kernel="grouped_matmul"`: the sorted dispatch's
    per-expert product of that shape) under `policy` on `platform`. Under `probed:T` a plain product's
    `probe()` (-> `invariance.Evidence`) decides between the bucketed plain product and the tiles (grouped
    products, attention and meshes keep the tiles). Raises a ValueError when the policy's semantics have no
    implementation there."""
    if policy.pallas_blocks is not None:
        _check_platform(platform, policy)
        check_blocks(policy.pallas_blocks, k, n, operand_dtype, policy.matmul_kernel, platform)
        return _chosen(Implementation(kernel, "pallas", platform, blocks=policy.pallas_blocks))
    tile = policy.tile_rows
    if tile is None:
        return _chosen(Implementation(kernel, "xla", platform))
    if policy.probed_kernel and kernel == "matmul" and probe is not None and not mesh_active():
        proof = probe()
        if proof.proven:
            return _chosen(Implementation(kernel, "xla-bucketed", platform, evidence=proof))
        if _lax_tiled(policy, platform):
            return _chosen(Implementation(kernel, "lax-tiled", platform, tile=tile, evidence=proof))
    if _lax_tiled(policy, platform):
        return _chosen(Implementation(kernel, "lax-tiled", platform, tile=tile))
    _require_f32(policy, platform)
    return _chosen(Implementation(kernel, "pallas", platform, tile=tile,
                                  blocks=derived_blocks(tile, operand_dtype, platform), derived=True))


def select_attention(policy: NumericPolicy, groups: int, head_dim: int, standard: bool,
                     platform: str) -> Implementation:
    """The implementation of attention with `groups` query heads per kv head of `head_dim`; `standard`: scale
    head_dim ** -0.5, values as wide as keys, no sparse key selection, sliding window or sinks (what the Pallas
    kernel computes)."""
    chunk = policy.attention_chunk
    if chunk is None:
        return _chosen(Implementation("attention", "lax-full", platform))
    if policy.pallas_blocks is not None:
        if not standard:
            raise ValueError(f"NumericPolicy.matmul_kernel = {policy.matmul_kernel!r} with attention = "
                             f"{policy.attention!r}: the Pallas attention kernel computes standard causal attention "
                             f"(scale head_dim ** -0.5, values as wide as keys, no sparse key selection, window "
                             f"or sinks); this model's attention (MLA, DSA, sinks or a sliding window) needs "
                             f"kernel=tiled:T or attn=full")
        _check_platform(platform, policy)
        bm = policy.pallas_blocks[0]
    elif policy.tile_rows is None or not standard or _lax_tiled(policy, platform):
        return _chosen(Implementation("attention", "lax-chunked", platform, tile=policy.tile_rows))
    else:
        _require_f32(policy, platform)
        bm = derived_blocks(policy.tile_rows, jnp.float32, platform)[0]
        if platform == "gpu":
            bm = max(bm, pl.next_power_of_2(-(-16 // groups)))
    check_attention_blocks(bm, chunk, groups, head_dim, policy.matmul_kernel, platform)
    return _chosen(Implementation("attention", "pallas", platform, tile=policy.tile_rows, blocks=(bm,),
                                  derived=policy.pallas_blocks is None))
