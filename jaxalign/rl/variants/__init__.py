"""GRPO variants, one small module each, registered by name on import (`jaxalign.rl.registry`)."""

from jaxalign.rl.variants import dr_grpo  # noqa: F401  (registers group-mean, seq-mean-token-sum-maxlen)
