"""4-bit weights under a NumericPolicy: MXFP4 (OCP Microscaling v1.0) and INT4 with group scales.

The policy's `weight_quant` names the format (`mxfp4`, `int4:G`) and `quant_scope` which weights carry it
(`experts`: routed experts only, as gpt-oss, DeepSeek-V4 and Kimi K3 serve them; `all`: every linear and expert
weight that FP8 would quantise). This module is the one place the formats are computed.

**MXFP4** (the spec's MX format with E2M1 elements, block size k = 32), for a weight [..., K, N] in blocks of 32
consecutive elements along K (one block per column; a last, shorter block where 32 does not divide K):
- the block's scale X = 2^(floor(log2(amax)) - 2), amax its largest |v| and 2 the largest exponent of E2M1;
  floor(log2(amax)) comes exactly from `frexp`. X is stored as float8_e8m0fnu (a biased exponent, 127 bias):
  exponents are clamped to [-127, 127] (0xFF is the spec's NaN);
- each element v / X rounded to E2M1 (0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives) to nearest, ties to even, and
  saturated to +-6 (E2M1 has no infinity: values between 6X and 8X become 6X);
- an all-zero block has the smallest scale, 2^-127 (its elements are zero whatever the scale); a block holding a
  NaN or an infinity has the NaN scale and decodes to NaN in every element (the spec: X = NaN makes the block NaN);
- the dequantised value is element * X in float32. E2M1 has 2 significant bits, so the value is exact in bf16,
  f16 and f32 wherever it is a normal number; XLA flushes float32 subnormals on the CPU, so values below 2^-126
  (and subnormal inputs, read as zero) dequantise to zero, on the engine's side and the trainer's alike.
Re-quantising dequantised MXFP4 values gives the same values (a power-of-two rescale of E2M1 values): a gpt-oss
checkpoint's MXFP4 experts held as float32 masters come back bit for bit.

**INT4** (`int4:G`, symmetric, as Kimi K2-Thinking's W4A16): one scale per G consecutive elements along K,
from the group's amax as FP8's are from a block's (`quant_scale` f32: amax * fl(1/7); e8m0: the smallest power
of two with amax <= 7 * scale; clamped to normal float32, an all-zero group has scale 1, a non-finite one NaN);
codes are round-half-even(v * fl(1/scale)) clipped to [-8, 7]; the value is fl32(code * scale).

**Products** (`numerics.fp8` routes them here): without `act_quant` (W4A16, how gpt-oss and DeepSeek-V4 FP4
experts are served) the dequantised weight is cast to the param dtype and multiplied by the policy's own product
(kernel, accumulation, dispatch: the product of the unquantised policy on other weights). With `act_quant=e4m3:B`
(W4A8) the activations are quantised in 1xB tiles and each tile's product with the dequantised weight is scaled
and summed as FP8's block product does. The engine quantises at every weight sync (its state holds
`LowBitWeight`s: codes and scales); the trainer quantises its float32 masters inside its forward with the same
functions (quantisation-aware training), the gradient straight through to the masters.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxalign.numerics.policy import NumericPolicy
from jaxalign.numerics.policy_values import Int4Groups, Mxfp4
from jaxalign.numerics.scales import pad_axis, scale_from_amax

E2M1_MAX = 6.0
E2M1_EMAX = 2  # the largest exponent of an E2M1 value (6 = 1.5 * 2^2)
MX_BLOCK = 32
SCALE_EXP_MIN, SCALE_EXP_MAX = -127, 127  # E8M0's range (0xFF is NaN)
INT4_MIN, INT4_MAX = -8, 7
INT4_SCALE_MAX = 7.0  # symmetric: amax maps to 7


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LowBitWeight:
    """A weight [..., K, N] as the engine holds it in a 4-bit format: `codes` and `scales` [..., ceil(K/G), N], G
    elements along K per scale. MXFP4: codes are float4_e2m1fn bit patterns, one per uint8 (`ml_dtypes`
    reads them with `.view(float4_e2m1fn)`), scales E8M0 bytes (biased exponents, 0xFF = NaN). INT4: codes int8
    in [-8, 7], scales float32. A parameter's value in the engine's state (`Variable[...]` returns it whole).
    (Bytes rather than XLA's float4/float8_e8m0 types: XLA:CPU fails to compile their vectorised conversions on
    CPUs without F16C, e.g. under `--xla_cpu_max_isa=SSE4_2`.)"""

    codes: jax.Array
    scales: jax.Array
    fmt: str = dataclasses.field(metadata=dict(static=True))
    group: int = dataclasses.field(metadata=dict(static=True))

    def __getitem__(self, key):
        if key is Ellipsis:
            return self
        raise TypeError("a LowBitWeight is read whole (weight[...]); use .codes / .scales / .dequantized()")

    @property
    def shape(self) -> tuple[int, ...]:
        return self.codes.shape

    @property
    def format_text(self) -> str:
        """The policy value this weight was quantised for (`mxfp4`, `int4:G`)."""
        return "mxfp4" if self.fmt == "mxfp4" else f"int4:{self.group}"

    def dequantized(self) -> jax.Array:
        """code * scale per group, float32 [..., K, N]."""
        if self.fmt == "mxfp4":
            values, scales = decode_e2m1(self.codes), decode_e8m0(self.scales)
        else:
            values, scales = self.codes.astype(jnp.float32), self.scales.astype(jnp.float32)
        return values * _per_element(scales, self.group, self.codes.shape[-2])


def _group_amax(w: jax.Array, group: int) -> jax.Array:
    """The largest |v| of each group of `group` consecutive elements along K of w [..., K, N]: [..., nK, N]
    (NaN where a group holds a NaN)."""
    padded = pad_axis(jnp.abs(w), -2, group)  # zeros: they do not change an amax
    lead, k, n = padded.shape[:-2], padded.shape[-2], padded.shape[-1]
    return jnp.max(padded.reshape(lead + (k // group, group, n)), axis=-2)


def _per_element(scales: jax.Array, group: int, k: int) -> jax.Array:
    return jnp.repeat(scales, group, axis=-2)[..., :k, :]


def mx_scale_exponents(amax: jax.Array) -> jax.Array:
    """The MXFP4 shared exponent floor(log2(amax)) - 2 of blocks whose largest |v| is `amax` (int32, clamped to
    [-127, 127]; -127 for an all-zero block). Non-finite blocks are the caller's (their scale is NaN)."""
    mantissa, exponent = jnp.frexp(amax.astype(jnp.float32))  # amax = m * 2^e, m in [0.5, 1): floor(log2) = e - 1
    shared = exponent - 1 - E2M1_EMAX
    return jnp.where(amax > 0, jnp.clip(shared, SCALE_EXP_MIN, SCALE_EXP_MAX), SCALE_EXP_MIN).astype(jnp.int32)


def _power_of_two(exponent: jax.Array) -> jax.Array:
    """2^exponent as float32, exactly, for integer exponents in [-126, 127] (the exponent field set directly)."""
    return jax.lax.bitcast_convert_type(((exponent + 127) << 23).astype(jnp.int32), jnp.float32)


def round_e2m1(x: jax.Array) -> jax.Array:
    """x (float32, already divided by its scale) rounded to the nearest E2M1 value, ties to even, saturated to +-6
    (E2M1 has no infinity), as float32. The grid's spacing is 0.5 below 2, 1 below 4 and 2 up to 6, so each
    binade rounds as round-half-even(|x| / spacing) * spacing, exactly."""
    x = x.astype(jnp.float32)
    magnitude = jnp.minimum(jnp.abs(x), E2M1_MAX)
    spacing = jnp.where(magnitude < 2.0, 0.5, jnp.where(magnitude < 4.0, 1.0, 2.0))
    return jnp.copysign(jax.lax.round(magnitude / spacing, jax.lax.RoundingMethod.TO_NEAREST_EVEN) * spacing, x)


def e2m1_codes(values: jax.Array) -> jax.Array:
    """The float4_e2m1fn bit patterns (uint8) of float32 values on the E2M1 grid: sign in bit 3, the magnitude's
    index among 0, 0.5, 1, 1.5, 2, 3, 4, 6 below it."""
    magnitude = jnp.abs(values)
    index = jnp.where(magnitude < 2.0, magnitude * 2.0, jnp.where(magnitude < 4.0, magnitude + 2.0,
                                                                  magnitude * 0.5 + 4.0))
    return (index.astype(jnp.uint8) | (jnp.signbit(values).astype(jnp.uint8) << 3)).astype(jnp.uint8)


def decode_e2m1(codes: jax.Array) -> jax.Array:
    """float32 values of float4_e2m1fn bit patterns (uint8)."""
    index = (codes & 7).astype(jnp.float32)
    magnitude = jnp.where(index < 4.0, index * 0.5, jnp.where(index < 6.0, index - 2.0, (index - 4.0) * 2.0))
    return jnp.where((codes & 8) > 0, -magnitude, magnitude)


def decode_e8m0(scales: jax.Array) -> jax.Array:
    """float32 values of E8M0 bytes: 2^(byte - 127), NaN for 0xFF. 2^-127 (byte 0) is a float32 subnormal, which
    XLA:CPU flushes: a scale 2^-127 decodes as 0 (only an all-zero block, or one whose values are themselves
    below float32's normal range, has it)."""
    exponent = scales.astype(jnp.int32) - 127
    value = jnp.where(exponent >= -126, _power_of_two(jnp.maximum(exponent, -126)), 0.0)
    return jnp.where(scales == 255, jnp.nan, value)


def quantize_mxfp4(w: jax.Array) -> LowBitWeight:
    """w [..., K, N] (float32 master) in MXFP4 blocks of 32 along K (see the module docstring)."""
    w = w.astype(jnp.float32)
    k = w.shape[-2]
    amax = _group_amax(w, MX_BLOCK)
    finite = jnp.isfinite(amax)
    exponent = mx_scale_exponents(jnp.where(finite, amax, 0.0))
    # v / X as v * 2^-e: -e lies in [-125, 127] (e <= 125 for any finite float32), a normal power of two
    inverse = _power_of_two(-exponent)
    values = round_e2m1(w * _per_element(inverse, MX_BLOCK, k))
    codes = jnp.where(_per_element(finite, MX_BLOCK, k), e2m1_codes(values), jnp.zeros((), jnp.uint8))
    # the E8M0 byte: exponent + 127, or 0xFF (NaN) for a non-finite block
    biased = jnp.where(finite, exponent + 127, 255).astype(jnp.uint8)
    return LowBitWeight(codes, biased, "mxfp4", MX_BLOCK)


def mxfp4_from_blocks(blocks: np.ndarray, scales: np.ndarray) -> LowBitWeight:
    """An MXFP4 checkpoint tensor (gpt-oss's `*_blocks` and `*_scales`, as transformers' `integrations/mxfp4.py`
    reads them) as a `LowBitWeight`, bit for bit: no value is computed or rounded.

    `blocks` [..., N, G, 16] uint8 holds, for each of N output rows, G blocks of 32 E2M1 codes along the
    contraction K = 32 G, two per byte: the low nibble is the even element, the high nibble the odd one (E2M1
    bit patterns: sign in bit 3, the magnitude's index among 0, 0.5, 1, 1.5, 2, 3, 4, 6 -- transformers'
    `FP4_VALUES` order); `scales` [..., N, G] uint8 are the blocks' E8M0 exponents (2^(byte - 127)). The weight
    comes out as jaxalign lays weights out, [..., K, N] (transformers' dequantised tensor transposed the same
    way: `gate_up_proj` [E, H, 2I], `down_proj` [E, I, H])."""
    blocks, scales = np.asarray(blocks), np.asarray(scales)
    if blocks.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.ndim < 3 or blocks.shape[-1] != MX_BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} and scales {scales.shape}: expected blocks [..., N, G, "
                         f"{MX_BLOCK // 2}] and scales [..., N, G]")
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1)  # [..., N, G, 16, 2]: even element, then odd
    codes = codes.reshape(*blocks.shape[:-2], blocks.shape[-2] * MX_BLOCK)  # [..., N, K]
    return LowBitWeight(jnp.asarray(np.swapaxes(codes, -1, -2)), jnp.asarray(np.swapaxes(scales, -1, -2)), "mxfp4",
                        MX_BLOCK)


def mxfp4_to_blocks(weight: LowBitWeight) -> tuple[np.ndarray, np.ndarray]:
    """The inverse of `mxfp4_from_blocks`: an MXFP4 `LowBitWeight` [..., K, N] as checkpoint `blocks` [..., N, K/32,
    16] (two E2M1 codes a byte, the even element in the low nibble) and `scales` [..., N, K/32] (E8M0 bytes)."""
    if weight.fmt != "mxfp4":
        raise ValueError(f"mxfp4_to_blocks takes an MXFP4 weight, got {weight.format_text}")
    codes = np.swapaxes(np.asarray(weight.codes, np.uint8), -1, -2)  # [..., N, K]
    if codes.shape[-1] % MX_BLOCK:
        raise ValueError(f"MXFP4 checkpoint blocks hold whole blocks of {MX_BLOCK}; K = {codes.shape[-1]}")
    pairs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // MX_BLOCK, MX_BLOCK // 2, 2)
    blocks = np.ascontiguousarray((pairs[..., 0] | (pairs[..., 1] << 4)).astype(np.uint8))
    return blocks, np.ascontiguousarray(np.swapaxes(np.asarray(weight.scales, np.uint8), -1, -2))


def quantize_int4(w: jax.Array, group: int, scale_format: str) -> LowBitWeight:
    """w [..., K, N] (float32 master) as symmetric INT4 with one scale per `group` along K (module docstring)."""
    w = w.astype(jnp.float32)
    k = w.shape[-2]
    amax = _group_amax(w, group)
    finite = jnp.isfinite(amax)
    scales = jnp.where(finite, scale_from_amax(jnp.where(finite, amax, 0.0), scale_format, INT4_SCALE_MAX),
                       jnp.nan)
    inverse = 1.0 / scales
    rounded = jnp.round(w * _per_element(inverse, group, k))  # half to even
    codes = jnp.where(jnp.isfinite(rounded), jnp.clip(rounded, INT4_MIN, INT4_MAX), 0.0).astype(jnp.int8)
    return LowBitWeight(codes, scales.astype(jnp.float32), "int4", group)


def quantize(w: jax.Array, policy: NumericPolicy) -> LowBitWeight:
    """w in the policy's 4-bit format (`weight_quant` = `mxfp4` or `int4:G`)."""
    fmt = policy.weight_quant
    if isinstance(fmt, Mxfp4):
        return quantize_mxfp4(w)
    if isinstance(fmt, Int4Groups):
        return quantize_int4(w, fmt.group, policy.quant_scale)
    raise ValueError(f"NumericPolicy.weight_quant = {fmt!r} is not a 4-bit format; allowed here: mxfp4, int4:G")


def dequantized(w) -> jax.Array:
    """A `LowBitWeight`'s values (float32)."""
    return w.dequantized()


def check_weight(w, policy: NumericPolicy) -> None:
    """A `LowBitWeight` is used only under the policy whose format it was quantised for."""
    if isinstance(w, LowBitWeight) and w.format_text != str(policy.weight_quant):
        raise ValueError(f"a weight quantised as {w.format_text} met NumericPolicy.weight_quant = "
                         f"{policy.weight_quant!r}; allowed: the policy the engine cast its weights with")


# --- references and probes ---------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def e2m1_values() -> np.ndarray:
    """Every float4_e2m1fn value, ascending, as float64 (0 once)."""
    import ml_dtypes
    return np.unique(np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float64))


def rounding_check() -> dict:
    """This backend's rounding into E2M1 against ml_dtypes' cast (nearest even, saturated to +-6), values and bit
    patterns: every E2M1 value, every midpoint, one float32 ulp either side of each, and values past the range."""
    import ml_dtypes
    v = e2m1_values()
    mids = ((v[1:] + v[:-1]) / 2).astype(np.float32)
    x = np.concatenate([v, -v, mids, np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf)),
                        [6.5, -6.5, 7.0, -7.0, 8.0, -8.0, 1e30, -1e30, -0.1, -0.25]]).astype(np.float32)
    values = jax.jit(round_e2m1)(x)
    got = np.asarray(values)
    codes = np.asarray(jax.jit(e2m1_codes)(values))
    decoded = np.asarray(jax.jit(decode_e2m1)(jnp.asarray(codes)))
    want = np.clip(x, -E2M1_MAX, E2M1_MAX).astype(ml_dtypes.float4_e2m1fn)
    same = ((got.view(np.uint32) == want.astype(np.float32).view(np.uint32)) & (codes == want.view(np.uint8))
            & (decoded.view(np.uint32) == got.view(np.uint32)))
    return {"cases": int(x.size), "mismatches": int(np.sum(~same)), "passed": bool(same.all())}
