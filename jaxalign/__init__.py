"""jaxalign: one JAX/Flax MoE transformer under two explicit numeric policies (trainer and rollout engine),
used to measure, localise and close the numerical gap between them."""

from jaxalign.numerics.xla_flags import disable_excess_precision

EXACT_LOW_PRECISION = disable_excess_precision()  # before any JAX computation; see numerics/xla_flags.py

from jaxalign.align.replay import RoutingRecord  # noqa: E402
from jaxalign.engine import Engine, Rollout, generate  # noqa: E402
from jaxalign.model import ModelConfig, Transformer, sequence_logprobs, token_logprobs  # noqa: E402
from jaxalign.model.sharding import make_mesh  # noqa: E402
from jaxalign.numerics import PRESETS, NumericPolicy  # noqa: E402

__version__ = "0.1.0"

__all__ = ["Engine", "Rollout", "generate", "make_mesh", "ModelConfig", "NumericPolicy", "PRESETS", "RoutingRecord", "Transformer", "sequence_logprobs",
           "token_logprobs", "__version__"]
