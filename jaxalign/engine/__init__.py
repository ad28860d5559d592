"""The rollout engine: KV-cache generation under an engine policy."""

from jaxalign.engine.engine import Engine, generate
from jaxalign.engine.rollout import Rollout

__all__ = ["Engine", "Rollout", "generate"]
