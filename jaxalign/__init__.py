"""jaxalign: one JAX/Flax MoE transformer under two explicit numeric policies (trainer and rollout engine),
used to measure, localise and close the numerical gap between them.

The public API, by role:
- core: `NumericPolicy`, `PRESETS`, `PolicySchedule`, `ModelConfig`, `Transformer`, `RoutingRecord`, `make_mesh`;
- engine (rollout side): `Engine`, `generate`, `Rollout`, `SamplingParams`;
- scoring (trainer side): `token_logprobs`, `sequence_logprobs`;
- analysis: `mismatch_metrics`, `routing_metrics`, `compare`, `localize`;
- subpackages: `jaxalign.interop.hf` / `jaxalign.interop.golden` (other stacks), `jaxalign.rl` (the RL loop),
  `jaxalign.runtime` (process state: XLA flags).
"""

# set XLA_FLAGS before any JAX computation
from jaxalign.runtime import EXACT_ELEMENTWISE, EXACT_LOW_PRECISION  # noqa: F401

from jaxalign import interop  # noqa: E402  (so `jaxalign.interop.hf` works after `import jaxalign`)
from jaxalign.align.compare import compare  # noqa: E402
from jaxalign.align.localize import localize  # noqa: E402
from jaxalign.metrics.mismatch import mismatch_metrics  # noqa: E402
from jaxalign.model.routing import RoutingRecord  # noqa: E402
from jaxalign.metrics.routing import routing_metrics  # noqa: E402
from jaxalign.engine import Engine, Rollout, generate  # noqa: E402
from jaxalign.model import ModelConfig, Transformer, sequence_logprobs, token_logprobs  # noqa: E402
from jaxalign.model.sharding import make_mesh  # noqa: E402
from jaxalign.numerics import PRESETS, NumericPolicy  # noqa: E402
from jaxalign.numerics.sampling import SamplingParams  # noqa: E402
from jaxalign.numerics.schedule import PolicySchedule  # noqa: E402

from jaxalign.version import __version__  # noqa: E402

__all__ = ["EXACT_ELEMENTWISE", "EXACT_LOW_PRECISION", "Engine", "ModelConfig", "NumericPolicy", "PRESETS", "PolicySchedule", "Rollout",
           "RoutingRecord", "SamplingParams", "Transformer", "compare", "generate", "localize", "make_mesh", "mismatch_metrics",
           "routing_metrics", "sequence_logprobs", "token_logprobs", "__version__"]
