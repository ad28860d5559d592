"""The one process-level XLA setting jaxalign needs: no excess precision.

By default XLA may keep float32 precision inside a fusion where the program asked for bf16/f16
(`xla_allow_excess_precision=true`). XLA:CPU has no bf16 arithmetic: it computes bf16 elementwise ops in f32,
and with excess precision allowed it rounds only at fusion boundaries. Fusion boundaries differ between the
engine's decode program and the trainer's full forward, so the same bf16 RoPE or gate product gave different
bits in the two programs. With excess precision off, every bf16 op rounds, so a policy's dtype means the same
thing in every program (tests/test_alignment.py shows the difference).

XLA reads XLA_FLAGS when its backend starts, so this must happen before the first JAX computation; importing
`jaxalign` does it. If JAX already ran something without the flag, a warning says so.
"""

from __future__ import annotations

import os
import warnings

FLAG = "--xla_allow_excess_precision=false"


def disable_excess_precision() -> bool:
    """Add the flag to XLA_FLAGS unless the user set xla_allow_excess_precision themselves.

    Returns True when the flag is (or will be) in effect for this process."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_allow_excess_precision" in flags:
        return FLAG in flags
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        warnings.warn("jaxalign was imported after JAX started its backend without "
                      f"XLA_FLAGS={FLAG}; bf16/f16 policies may then round differently in different programs. "
                      "Import jaxalign (or set XLA_FLAGS) before the first JAX computation.", stacklevel=3)
        return False
    os.environ["XLA_FLAGS"] = (flags + " " + FLAG).strip()
    return True
