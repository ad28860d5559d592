"""jaxalign: one JAX/Flax MoE transformer under two explicit numeric policies (trainer and rollout engine),
used to measure, localise and close the numerical gap between them."""

from jaxalign.align.replay import RoutingRecord
from jaxalign.engine import Engine, Rollout, generate
from jaxalign.model import ModelConfig, Transformer, sequence_logprobs, token_logprobs
from jaxalign.numerics import PRESETS, NumericPolicy

__version__ = "0.1.0"

__all__ = ["Engine", "Rollout", "generate", "ModelConfig", "NumericPolicy", "PRESETS", "RoutingRecord", "Transformer", "sequence_logprobs",
           "token_logprobs", "__version__"]
