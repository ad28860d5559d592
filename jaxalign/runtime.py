"""Process state jaxalign owns: every write to XLA_FLAGS, the one probe of JAX internals, and the check that an
aligned policy's bitwise promise can hold in this process.

XLA reads XLA_FLAGS once, when its backend starts, so both settings here must be made before the first JAX
computation:

- **No excess precision** (`--xla_allow_excess_precision=false`, set when `jaxalign` is imported). By default
  XLA may keep float32 precision inside a fusion where the program asked for bf16/f16. XLA:CPU has no bf16
  arithmetic: it computes bf16 elementwise ops in f32 and, with excess precision allowed, rounds only at fusion
  boundaries. Fusion boundaries differ between the engine's decode program and the trainer's full forward, so the
  same bf16 RoPE or gate product gave different bits in the two programs. With the flag, every bf16 op rounds, so
  a policy's dtype means the same thing in every program (tests/test_alignment.py shows the difference). A user
  who forces excess precision on keeps it, but a policy that promises bitwise agreement is then refused
  (`require_exact_rounding`) instead of silently breaking its promise.
- **No YNNPACK reduce fusions** (`--xla_cpu_experimental_ynn_fusion_type=-reduce`, set when `jaxalign` is
  imported). XLA:CPU hands a reduce and the elementwise ops around it (a softmax's max, subtract and exp) to a
  YNNPACK kernel once the array is large enough (on a 2-core Xeon: from ~7k float32 elements, e.g. a [912, 8]
  router softmax, not at [304, 8]), and YNNPACK's exp is not XLA's: about one value in 40 came out one float32
  ulp apart. So the trainer's full forward over 256 x 38 tokens computed the router softmax with YNNPACK and
  the engine's 256-row decode step with XLA's own exp -- the same logits, different gate weights (found in an
  aligned RL run: one step in 60 had KL 2e-6). With the flag, every program keeps XLA's own elementwise code.
  A user who sets the flag to something that keeps reduce fusions keeps it, and a bitwise-promising policy is
  then refused (`require_exact_rounding`).
- **Fake CPU devices** for meshes on one host (`configure(host_devices=N)`, the CLI's `--host-devices`).
"""

from __future__ import annotations

import os
import re
import warnings

from jaxalign.numerics.policy import NumericPolicy
from jaxalign.numerics.schedule import PolicySchedule

EXCESS_PRECISION_OFF = "--xla_allow_excess_precision=false"
YNN_FUSION_FLAG = "xla_cpu_experimental_ynn_fusion_type"
YNN_REDUCE_OFF = f"--{YNN_FUSION_FLAG}=-reduce"
_HOST_DEVICES = "xla_force_host_platform_device_count"


def backend_started() -> bool:
    """True once JAX has started a backend (after which XLA_FLAGS changes have no effect). The one place jaxalign
    reads JAX internals; if they move, this answers False and the callers' flags are merely set too late."""
    try:
        from jax._src import xla_bridge
        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # pragma: no cover - a JAX without the probe
        return False


def _append_flag(flag: str) -> None:
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


def disable_excess_precision() -> bool:
    """Add EXCESS_PRECISION_OFF to XLA_FLAGS unless the user set `xla_allow_excess_precision` themselves.

    Returns True when exact low-precision rounding is (or will be) in effect for this process."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_allow_excess_precision" in flags:
        return EXCESS_PRECISION_OFF in flags
    if backend_started():
        warnings.warn("jaxalign was imported after JAX started its backend without "
                      f"XLA_FLAGS={EXCESS_PRECISION_OFF}; bf16/f16 policies may then round differently in different "
                      "programs. Import jaxalign (or set XLA_FLAGS) before the first JAX computation.", stacklevel=3)
        return False
    _append_flag(EXCESS_PRECISION_OFF)
    return True


EXACT_LOW_PRECISION = disable_excess_precision()  # run on import: before any JAX computation


def _ynn_reduce_enabled(flags: str) -> bool:
    """Whether XLA_FLAGS text `flags` leaves XLA:CPU's YNNPACK reduce fusions on (on by default): the last
    `--xla_cpu_experimental_ynn_fusion_type` wins; a signed list ('+a,-b') edits the default, a plain one
    replaces it."""
    values = re.findall(rf"--{YNN_FUSION_FLAG}=(\S*)", flags)
    if not values:
        return True
    items = [v for v in values[-1].split(",") if v]
    if items and all(v[0] in "+-" for v in items):
        signed = [v for v in items if v[1:] == "reduce"]
        return not signed or signed[-1] == "+reduce"
    return "reduce" in items


def disable_ynn_reduce_fusion() -> bool:
    """Add YNN_REDUCE_OFF to XLA_FLAGS unless the user set `xla_cpu_experimental_ynn_fusion_type` themselves.

    Returns True when no YNNPACK reduce fusion will run in this process (see the module docstring)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if YNN_FUSION_FLAG in flags:
        return not _ynn_reduce_enabled(flags)
    if backend_started():
        warnings.warn("jaxalign was imported after JAX started its backend without "
                      f"XLA_FLAGS={YNN_REDUCE_OFF}; large softmaxes may then run YNNPACK's exp in some programs and "
                      "XLA's in others. Import jaxalign (or set XLA_FLAGS) before the first JAX computation.",
                      stacklevel=3)
        return False
    _append_flag(YNN_REDUCE_OFF)
    return True


EXACT_ELEMENTWISE = disable_ynn_reduce_fusion()  # run on import: before any JAX computation


def promises_bitwise(policy: NumericPolicy) -> bool:
    """A policy made to give the same bits in every program (aligned presets): batch-invariant kernels and
    fixed-order reductions."""
    return policy.batch_invariant_kernel and policy.tree_reduction


def require_exact_rounding(policy: NumericPolicy | PolicySchedule) -> None:
    """Refuse a bitwise-promising bf16/f16 policy (or a schedule holding one) in a process where XLA may keep
    excess precision, and any bitwise-promising policy where YNNPACK reduce fusions are on: its trainer == engine
    promise would silently not hold (see the module docstring)."""
    if isinstance(policy, PolicySchedule):
        for part_policy in (policy.default, *(p for _, p in policy.rules)):
            require_exact_rounding(part_policy)
        return
    if not EXACT_LOW_PRECISION and promises_bitwise(policy) and policy.rounds_below_f32:
        raise ValueError(
            f"policy {policy} promises bitwise agreement between programs, but this process runs XLA with excess "
            f"precision allowed (XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}, or JAX started before jaxalign was "
            f"imported), so bf16/f16 ops round only at fusion boundaries that differ between programs. Allowed: "
            f"drop xla_allow_excess_precision from XLA_FLAGS (jaxalign sets {EXCESS_PRECISION_OFF}) and import "
            f"jaxalign before the first JAX computation, or use a policy with kernel=xla / reduce=xla.")
    if not EXACT_ELEMENTWISE and promises_bitwise(policy):
        raise ValueError(
            f"policy {policy} promises bitwise agreement between programs, but this process lets XLA:CPU hand large "
            f"reductions and the elementwise ops around them to YNNPACK (XLA_FLAGS="
            f"{os.environ.get('XLA_FLAGS', '')!r}, or JAX started before jaxalign was imported), whose exp rounds "
            f"differently from XLA's, so a softmax's bits depend on the batch. Allowed: drop {YNN_FUSION_FLAG} "
            f"from XLA_FLAGS or make it exclude reduce (jaxalign sets {YNN_REDUCE_OFF}) and import jaxalign before "
            f"the first JAX computation, or use a policy with kernel=xla / reduce=xla.")


def configure(*, host_devices: int | None = None) -> None:
    """Process settings for the CLI and scripts, made before JAX starts: `host_devices` fakes that many CPU
    devices (for meshes on one host). If JAX already started with at least that many devices this is a no-op."""
    if host_devices is None:
        return
    if not isinstance(host_devices, int) or host_devices < 1:
        raise ValueError(f"host_devices = {host_devices!r}; allowed: a positive int")
    if backend_started():
        import jax
        if jax.device_count() < host_devices:
            raise ValueError(f"host_devices = {host_devices}: JAX already started with {jax.device_count()} "
                             f"devices; set it before the first JAX computation")
        return
    if _HOST_DEVICES not in os.environ.get("XLA_FLAGS", ""):
        _append_flag(f"--{_HOST_DEVICES}={host_devices}")
