"""Block scales shared by the quantised formats (FP8 in `fp8`, INT4 in `lowbit`): a scale from a block's amax."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

_MIN_EXP, _MAX_EXP = -126, 126


def scale_from_amax(amax: jax.Array, scale_format: str, element_max: float) -> jax.Array:
    """The float32 scale of blocks whose largest |x| is `amax`, for elements whose largest value is `element_max`
    (448 for e4m3, 7 for INT4): `f32` = amax * fl(1 / element_max) (stated as that product: XLA rewrites a
    division by a constant into it in some programs only); `e8m0` = the smallest power of two 2^e with
    amax <= element_max * 2^e (exact integer logic on the exponent). An all-zero block has scale 1; scales are
    clamped to [2^-126, 2^126] (normal float32, so 1 / scale is exact for e8m0 and finite)."""
    amax = amax.astype(jnp.float32)
    if scale_format == "e8m0":
        max_mantissa, max_exponent = math.frexp(element_max)  # e.g. 448 = 0.875 * 2^9, 7 = 0.875 * 2^3
        mantissa, exponent = jnp.frexp(amax)  # amax = m * 2^e, m in [0.5, 1)
        e = exponent - max_exponent + (mantissa > max_mantissa).astype(exponent.dtype)
        scale = jnp.ldexp(jnp.ones_like(amax), jnp.clip(e, _MIN_EXP, _MAX_EXP))
    elif scale_format == "f32":
        inverse_max = np.float32(1.0) / np.float32(element_max)
        scale = jnp.clip(amax * inverse_max, np.float32(2.0 ** _MIN_EXP), np.float32(2.0 ** _MAX_EXP))
    else:
        raise ValueError(f"scale format {scale_format!r}; allowed: f32, e8m0")
    return jnp.where(amax > 0, scale, jnp.ones_like(scale))


def pad_axis(x: jax.Array, axis: int, multiple: int) -> jax.Array:
    """x zero-padded at the end of `axis` to a multiple of `multiple`."""
    pad = (-x.shape[axis]) % multiple
    if not pad:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, pad)
    return jnp.pad(x, widths)
