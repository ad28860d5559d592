"""FP8 (e4m3) weights, activations, products and KV cache under a NumericPolicy, DeepSeek-style.

The policy's fields (`weight_quant`, `act_quant`, `quant_scale`, `kv_quant`) state the semantics; this module is
the one place they are computed:

- **Scale** of a block or tile from its amax (the largest |x|, exact in any order): `f32` = amax * fl(1/448)
  (stated as that product: XLA rewrites a division by a constant into it in some programs only); `e8m0` = the
  smallest power of two 2^e with amax <= 448 * 2^e (exact integer logic on the exponent). An all-zero block has
  scale 1; scales are clamped to [2^-126, 2^126] (normal float32, so 1 / scale is exact for e8m0 and finite).
- **Rounding** into float8_e4m3fn: x * fl(1 / scale) in float32, clipped to +-448 (saturation: e4m3fn has no
  infinity), then XLA's convert, which rounds to nearest even (ml_dtypes' cast: tests/test_fp8.py).
- **Weights** (`weight_quant=e4m3:RxC`): every linear and routed-expert weight [..., K, N] in [R, C] blocks (R
  along K; a last, partial block where R or C does not divide the dimension), quantised from the float32 master.
  The engine does it once per weight sync (`cast_params`: its state then holds `QuantizedWeight`s); the trainer
  does it inside its forward (same function, same master, same bits), with a straight-through gradient.
- **Activations** (`act_quant=e4m3:B`): the input [..., K] of each such product in 1xB tiles along K, scales
  from the tile's own amax at run time (per row: batch invariant).
- **Product**: the contraction is cut into chunks that lie in one activation tile and one weight block (chunk =
  gcd(B, R)); each chunk is one product of the e4m3 values -- upcast exactly to the compute dtype: e4m3 has 4
  significant bits and bf16/f16/f32 hold every e4m3 value -- through the policy's kernel (`tiled:T` stays batch
  invariant) with float32 accumulation at HIGHEST precision; the chunk's [M, N] result is multiplied by
  (activation scale * weight scale) in float32 and the chunks are summed in chunk order (under `reduce=tree`
  each scaled chunk is kept from being contracted into an FMA with the running sum: `reduce.uncontracted`).
  The result is cast to the compute dtype.
- **Gradient** (trainer): straight through to the master weight and the unquantised input -- the VJP of the
  unquantised product `matmul(x, as_param(w))` of the same policy (as if both quantisations were the identity).
- **KV cache** (`kv_quant=e4m3`; `e5m2`: a direct cast without scales, as vLLM's `fp8_e5m2` cache): keys (after RoPE) and values quantised per token and kv head over head_dim
  (MLA: per token over its latent cache row), stored as e4m3 * scale rounded to `kv_cache_dtype`: the engine's
  cache and the trainer's full forward hold the same values. vLLM's FP8 KV cache uses per-tensor scales (or
  per-attention-head ones, calibrated offline); per-token-per-head dynamic scales need no calibration and suit
  the tiny models. The cache's memory is that of `kv_cache_dtype` (the values are stored dequantised).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxalign.numerics.dtypes import as_param, cast, dtype
from jaxalign.numerics import lowbit, precision
from jaxalign.numerics import scales as scales_lib
from jaxalign.numerics.collectives import gather_axes, local_reduce
from jaxalign.numerics.kernels import select_matmul
from jaxalign.numerics.matmul import (_ends_passed, _to_tiles, as_computed, expert_matmul, grouped_matmul, matmul,
                                      row_tiles, tile_layout)
from jaxalign.numerics.platforms import platform
from jaxalign.numerics.policy import NumericPolicy
from jaxalign.numerics.reduce import uncontracted

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0

# which parameters hold quantised weights: linear and routed-expert weights (with a LoRA adapter: the merged
# weight, merged in the param dtype first); not the embedding, the LM head (its weight is read directly), the
# router, the adapters themselves, or MLA's kv_b (read per head by numerics/mla.py)
QUANTIZED_LEAVES = ("w", "w_gate", "w_up", "w_down")
UNQUANTIZED_MODULES = ("lm_head", "kv_b_proj", "router")
EXPERT_LEAVES = ("w_gate", "w_up", "w_down")  # the routed experts' stacked [E, K, N] weights (`quant_scope=experts`)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class QuantizedWeight:
    """A weight [..., K, N] as the engine holds it: e4m3 `values` and float32 `scales` [..., ceil(K/R), ceil(N/C)]
    for blocks (R, C). A parameter's value in the engine's state (`Variable[...]` returns it whole)."""

    values: jax.Array
    scales: jax.Array
    blocks: tuple[int, int] = dataclasses.field(metadata=dict(static=True))

    def __getitem__(self, key):
        if key is Ellipsis:
            return self
        raise TypeError("a QuantizedWeight is read whole (weight[...]); use .values / .scales")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    def dequantized(self) -> jax.Array:
        """values * scale per block, float32 (for inspection; the products never form it)."""
        return self.values.astype(jnp.float32) * _expand(self.scales, self.blocks, self.values.shape)


def scale_from_amax(amax: jax.Array, scale_format: str) -> jax.Array:
    """The float32 scale of e4m3 blocks whose largest |x| is `amax` (`scales.scale_from_amax` with 448; see the
    module docstring)."""
    return scales_lib.scale_from_amax(amax, scale_format, E4M3_MAX)


def to_e4m3(x: jax.Array, scale: jax.Array) -> jax.Array:
    """x / scale rounded to float8_e4m3fn (x * fl(1 / scale) in float32, saturated to +-448, nearest even);
    `scale` broadcasts against x."""
    inverse = 1.0 / scale.astype(jnp.float32)
    return jnp.clip(x.astype(jnp.float32) * inverse, -E4M3_MAX, E4M3_MAX).astype(E4M3)


_pad_to = scales_lib.pad_axis


def _expand(scales: jax.Array, blocks: tuple[int, int], shape: tuple[int, ...]) -> jax.Array:
    """Block scales [..., nK, nN] repeated over their blocks and cut to `shape` [..., K, N]."""
    r, c = blocks
    full = jnp.repeat(jnp.repeat(scales, r, axis=-2), c, axis=-1)
    return full[..., :shape[-2], :shape[-1]]


def quantize_weight(w: jax.Array, blocks: tuple[int, int], scale_format: str) -> QuantizedWeight:
    """w [..., K, N] (float32 master) in e4m3 [R, C] blocks."""
    r, c = blocks
    k, n = w.shape[-2:]
    w = w.astype(jnp.float32)
    padded = _pad_to(_pad_to(jnp.abs(w), -2, r), -1, c)  # zeros: they do not change an amax
    lead = padded.shape[:-2]
    tiles = padded.reshape(lead + (padded.shape[-2] // r, r, padded.shape[-1] // c, c))
    scales = scale_from_amax(jnp.max(tiles, axis=(-3, -1)), scale_format)
    return QuantizedWeight(to_e4m3(w, _expand(scales, blocks, w.shape)), scales, (r, c))


def quantize_tiles(x: jax.Array, tile: int, scale_format: str) -> tuple[jax.Array, jax.Array]:
    """x [..., K] in e4m3 1x`tile` tiles along K: (values e4m3 [..., K], scales float32 [..., ceil(K/tile)])."""
    k = x.shape[-1]
    x = x.astype(jnp.float32)
    padded = _pad_to(jnp.abs(x), -1, tile)
    scales = scale_from_amax(jnp.max(padded.reshape(x.shape[:-1] + (-1, tile)), axis=-1), scale_format)
    return to_e4m3(x, jnp.repeat(scales, tile, axis=-1)[..., :k]), scales


E5M2 = jnp.float8_e5m2
E5M2_MAX = 57344.0


def kv_entries(x: jax.Array, policy: NumericPolicy) -> jax.Array:
    """Keys or values [..., D] as an FP8 KV cache stores them, read back in `kv_cache_dtype`: under
    `kv_quant=e4m3` with one scale per leading index (per token and kv head), value * scale; under `e5m2` cast
    directly, no scale (vLLM's `fp8_e5m2` cache; saturated to +-57344, nearest even)."""
    if policy.kv_quant == "e5m2":
        return cast(jnp.clip(x.astype(jnp.float32), -E5M2_MAX, E5M2_MAX).astype(E5M2), policy.kv_cache_dtype)
    q, scales = quantize_tiles(x, x.shape[-1], policy.quant_scale)
    return cast(q.astype(jnp.float32) * scales, policy.kv_cache_dtype)


def is_quantized_leaf(names: tuple[str, ...], scope: str = "all") -> bool:
    """Whether the parameter at this path (module names then the leaf's) holds a quantised weight under
    `quant_scope` `scope`: every linear and routed-expert weight (`all`) or the routed experts' alone
    (`experts`)."""
    leaves = EXPERT_LEAVES if scope == "experts" else QUANTIZED_LEAVES
    return bool(names) and names[-1] in leaves and not set(names[:-1]) & set(UNQUANTIZED_MODULES)


def is_quantized(w) -> bool:
    """Whether `w` is a weight as the engine holds it under a quantising policy (FP8 blocks or 4-bit)."""
    return isinstance(w, (QuantizedWeight, lowbit.LowBitWeight))


def check_weight(w, policy: NumericPolicy) -> None:
    """A quantised weight is used only under the policy whose format (and blocks) it was quantised for."""
    if isinstance(w, QuantizedWeight) and w.blocks != policy.weight_blocks:
        raise ValueError(f"a weight quantised in {w.blocks} blocks met NumericPolicy.weight_quant = "
                         f"{policy.weight_quant!r}; allowed: the policy the engine cast its weights with")
    lowbit.check_weight(w, policy)


# --- block-scaled products ----------------------------------------------------------------------------------

def _chunks(k: int, policy: NumericPolicy) -> list[tuple[int, int, int | None, int | None]]:
    """(start, stop, activation tile, weight block) of each contraction chunk: chunks of gcd(B, R) (or whichever
    is set) lie inside one tile and one block; the last may be shorter."""
    tile, blocks = policy.act_tile, policy.weight_blocks
    rows = blocks[0] if blocks else None
    size = math.gcd(tile, rows) if tile and rows else (tile or rows)
    return [(s, min(s + size, k), s // tile if tile else None, s // rows if rows else None)
            for s in range(0, k, size)]


def _operands(w, policy: NumericPolicy) -> tuple[jax.Array, jax.Array | None]:
    """(weight values in the compute dtype, block scales or None): a `QuantizedWeight`'s e4m3 values upcast (exact:
    every e4m3 value is a bf16, f16 and f32 value), or an unquantised weight (act_quant only) cast."""
    cdt = dtype(policy.compute_dtype)
    if isinstance(w, QuantizedWeight):
        return w.values.astype(cdt), w.scales
    if isinstance(w, lowbit.LowBitWeight):  # W4A8: the 4-bit weight's values, in the param dtype, then compute
        return cast(as_param(w.dequantized(), policy), policy.compute_dtype), None
    return cast(w, policy.compute_dtype), None


def _block_sum(x: jax.Array, values: jax.Array, scales: jax.Array | None, policy: NumericPolicy, dot,
               weight_scale) -> jax.Array:
    """The block-scaled product of rows x [..., M, K] (compute dtype) and weight `values` [..., K, N] (see
    `_operands`) as float32: the activation quantised in its tiles (if the policy says), then per contraction
    chunk `dot(x_chunk, w_chunk)` (float32) times its scales, summed in chunk order.
    `weight_scale(block_scales [..., N_blocks]) -> broadcastable to [..., M, N]` places one K block's weight
    scales against the chunk's result."""
    if policy.act_tile:
        xq, x_scales = quantize_tiles(x, policy.act_tile, policy.quant_scale)
        x = xq.astype(values.dtype)
    else:
        x, x_scales = cast(x, policy.compute_dtype), None
    total = None
    for start, stop, a, b in _chunks(x.shape[-1], policy):
        part = dot(x[..., start:stop], values[..., start:stop, :])
        scale = None if x_scales is None else x_scales[..., a:a + 1]
        if scales is not None:
            ws = weight_scale(scales[..., b, :])
            scale = ws if scale is None else scale * ws
        term = uncontracted(part * scale, policy)
        total = term if total is None else total + term
    return total


def _f32_dot(policy: NumericPolicy):
    return lambda a, b: precision.dot(a, b, policy)


def _columns(blocks: tuple[int, int] | None, n: int):
    """One K block's weight scales [..., nN] repeated over their C columns, as a row: [..., 1, N]."""
    return lambda s: jnp.repeat(s, blocks[1], axis=-1)[..., None, :n]


def _linear_block(x2d: jax.Array, w, policy: NumericPolicy) -> jax.Array:
    """x2d [M, K] times one weight (`QuantizedWeight` or unquantised) -> float32 [M, N]: whole rows under the xla
    kernel, fixed [T, K] row tiles under `tiled:T` (batch invariant), per-chunk Pallas products under Pallas."""
    k, n = w.shape[-2:]
    values, scales = _operands(w, policy)
    x2d, values = local_reduce(x2d, policy, (1,)), local_reduce(values, policy, (0,))  # no sum across devices
    columns = _columns(getattr(w, "blocks", None), n)
    impl = select_matmul(policy, k, n, values.dtype, platform())
    if impl.kind == "pallas":
        dot = lambda a, b: matmul(a, b, policy, operand_dtype=policy.compute_dtype, out_dtype="f32")  # noqa: E731
        return _block_sum(x2d, values, scales, policy, dot, columns)
    if impl.kind == "lax-tiled":
        x2d, values, scales = as_computed(x2d, values, scales)
    product = lambda rows: _block_sum(rows, values, scales, policy, _f32_dot(policy), columns)  # noqa: E731
    return row_tiles(x2d, product, impl.tile if impl.kind == "lax-tiled" else None)


def _straight_through(forward, plain):
    """forward(*operands) in the forward pass; the gradient of plain(*operands) (autodiff's) in the backward."""
    @jax.custom_vjp
    def wrapped(*operands):
        return forward(*operands)

    def fwd(*operands):
        return forward(*operands), operands

    def bwd(operands, g):
        _, vjp = jax.vjp(plain, *operands)
        return vjp(g)

    wrapped.defvjp(fwd, bwd)
    return wrapped


def _weight(w, policy: NumericPolicy):
    """The weight operand of a quantised product: the engine's `QuantizedWeight` / `LowBitWeight` as it is; a
    master quantised here (the trainer); unquantised (act_quant only) in the param dtype."""
    check_weight(w, policy)
    if is_quantized(w):
        return w
    if policy.weight_blocks is not None:
        return quantize_weight(w, policy.weight_blocks, policy.quant_scale)
    if policy.lowbit_weights:
        return lowbit.quantize(w, policy)
    return as_param(w, policy)


def _product(block_product, plain_product, policy: NumericPolicy, x, w, *rest):
    """block_product(x, weight operand, *rest) -- straight-through to plain_product(x, w, *rest) when w is a
    master (the trainer); the engine's quantised weight needs no gradient. A 4-bit weight without activation
    quantisation (W4A16) is multiplied by plain_product itself, on its dequantised values (`numerics.lowbit`)."""
    if policy.lowbit_weights and policy.act_tile is None:
        block_product = lambda x, w, *rest: plain_product(x, w.dequantized(), *rest)  # noqa: E731
    if is_quantized(w):
        check_weight(w, policy)
        return block_product(x, w, *rest)
    forward = lambda x, w, *rest: block_product(x, _weight(w, policy), *rest)  # noqa: E731
    return _straight_through(forward, plain_product)(x, w, *rest)


def linear(x: jax.Array, w, policy: NumericPolicy) -> jax.Array:
    """x [..., K] @ w [K, N] -> [..., N] in the compute dtype, block-scaled (w: master or `QuantizedWeight`)."""
    def block_product(x, w):
        y = _linear_block(x.reshape(-1, x.shape[-1]), w, policy)
        return cast(y.reshape(x.shape[:-1] + (w.shape[-1],)), policy.compute_dtype)

    plain = lambda x, w: matmul(x, as_param(w, policy), policy)  # noqa: E731
    return _product(block_product, plain, policy, x, w)


def expert_linear(x: jax.Array, w, policy: NumericPolicy) -> jax.Array:
    """Per-expert products x [E, R, K] @ w [E, K, N] -> [E, R, N], block-scaled (`matmul.expert_matmul`'s: one
    expert at a time under the tiled and Pallas kernels)."""
    def block_product(x, w):
        one = lambda xe, we: _linear_block(xe, we, policy)  # noqa: E731
        if policy.tile_rows is None and policy.pallas_blocks is None:
            y = jax.vmap(one)(x, w)
        else:
            y = lax.map(lambda pair: one(*pair), (x, w))
        return cast(y, policy.compute_dtype)

    plain = lambda x, w: expert_matmul(x, as_param(w, policy), policy)  # noqa: E731
    return _product(block_product, plain, policy, x, w)


def grouped_linear(x: jax.Array, w, group_sizes: jax.Array, policy: NumericPolicy) -> jax.Array:
    """Rows sorted by expert: x [R, K] @ w [E, K, N] per group -> [R, N], block-scaled (`matmul.grouped_matmul`'s
    layouts: per-expert [T, K] tiles under `tiled:T`, per-chunk ragged or Pallas products otherwise); each row
    takes its expert's weight scales."""
    def block_product(x, w, group_sizes):
        experts, k, n = w.shape
        values, scales = _operands(w, policy)
        x, values = local_reduce(x, policy, (1,)), local_reduce(values, policy, (0, 1, 2))
        blocks = getattr(w, "blocks", None)
        impl = select_matmul(policy, k, n, values.dtype, platform(), kernel="grouped_matmul")
        if impl.kind == "lax-tiled":
            n_tiles, dest, tile_expert = tile_layout(group_sizes, x.shape[0], impl.tile)
            tiles = _to_tiles(x, dest, n_tiles, impl.tile)

            def one_tile(carry, tile_and_expert):
                t, e = tile_and_expert
                y = _block_sum(t, values[e], None if scales is None else scales[e], policy, _f32_dot(policy),
                               _columns(blocks, n))
                return carry, gather_axes(y, (0,))
            _, out = lax.scan(one_tile, None, (tiles, tile_expert))
            y = out.reshape(-1, n)[dest]
        else:
            row_expert = jnp.minimum(_ends_passed(jnp.cumsum(group_sizes), jnp.arange(x.shape[0])), experts - 1)
            dot = lambda a, b: grouped_matmul(a, b, group_sizes, policy, out_dtype="f32")  # noqa: E731
            per_row = lambda s: _columns(blocks, n)(s)[row_expert, 0]  # noqa: E731  [R, N]
            y = _block_sum(x, values, scales, policy, dot, per_row)
        return cast(y, policy.compute_dtype)

    plain = lambda x, w, sizes: grouped_matmul(x, as_param(w, policy), sizes, policy)  # noqa: E731
    return _product(block_product, plain, policy, x, w, group_sizes)


def cast_weight(x: jax.Array, names: tuple[str, ...], policy: NumericPolicy):
    """A parameter at weight sync: a `QuantizedWeight` (FP8) or `lowbit.LowBitWeight` (4-bit) where the policy
    quantises this leaf (`weight_quant`, `quant_scope`), else None (the caller casts it as usual)."""
    if policy.weight_quant == "none" or not is_quantized_leaf(names, policy.quant_scope):
        return None
    if policy.weight_blocks is not None:
        return quantize_weight(x, policy.weight_blocks, policy.quant_scale)
    return lowbit.quantize(x, policy)


@functools.lru_cache(maxsize=None)
def e4m3_values() -> np.ndarray:
    """Every finite float8_e4m3fn value, ascending, as float64 (for references and probes)."""
    import ml_dtypes
    values = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return np.unique(values[np.isfinite(values)])


# --- probes (`jaxalign check`) -------------------------------------------------------------------------------

def probe_kernels(w: jax.Array, policy: NumericPolicy) -> dict:
    """`jaxalign check`'s batch-invariance probe of the quantised product under `policy` (which quantises): name
    (`fp8_matmul`, `mxfp4_matmul`, `int4_matmul`) -> (kernel on rows [b, K]); the weight [K, N] quantised once,
    as the engine holds it."""
    weight = _weight(w, policy) if policy.weight_quant != "none" else w
    name = str(policy.weight_quant).split(":")[0] if policy.lowbit_weights else "fp8"
    return {f"{name}_matmul": lambda x: linear(x, weight, policy)}


def rounding_check() -> dict:
    """This backend's rounding into e4m3 against ml_dtypes' cast (round to nearest even, saturated to +-448):
    every e4m3 value, every midpoint, one float32 ulp either side of each, and values past the range."""
    import ml_dtypes
    v = e4m3_values()
    mids = ((v[1:] + v[:-1]) / 2).astype(np.float32)
    x = np.concatenate([v, mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf)),
                        [449.0, -449.0, 464.0, -464.0, 1e30, -1e30]]).astype(np.float32)
    got = np.asarray(jax.jit(lambda a: to_e4m3(a, jnp.float32(1.0)))(x)).view(np.uint8)
    want = np.clip(x, -E4M3_MAX, E4M3_MAX).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return {"cases": int(x.size), "mismatches": int(np.sum(got != want)), "passed": bool(np.array_equal(got, want))}
