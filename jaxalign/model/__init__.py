"""The MoE transformer: config, layers, attention, MoE, the model and trainer-side scoring."""

from jaxalign.model.config import ModelConfig
from jaxalign.model.scoring import sequence_logprobs, token_logprobs
from jaxalign.model.transformer import Transformer

__all__ = ["ModelConfig", "Transformer", "sequence_logprobs", "token_logprobs"]
