"""The small GRPO run shared by the trainer, mesh and two-process tests (one definition, so runs compare)."""

from jaxalign.rl.correction import CorrectionConfig
from jaxalign.rl.grpo import GRPOConfig
from jaxalign.rl.sft import SFTConfig
from jaxalign.rl.trainer import RLConfig

SFT = SFTConfig(problems=300, steps=30)


def rl_config(**overrides) -> RLConfig:
    """3 steps (unless overridden) of 4 problems x 2 completions, checkpoint every 2 steps, aligned-bf16 on both
    sides."""
    settings = dict(steps=3, prompts_per_step=4, grpo=GRPOConfig(group_size=2), max_new_tokens=20,
                    checkpoint_every=2, eval_every=3, eval_problems=8,
                    correction=CorrectionConfig(rs=("seq_mean_k1:0.999_1.001",)))
    settings.update(overrides)
    return RLConfig(**settings)


def strip_timing(rows):
    """Metric rows without wall-clock fields."""
    return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]
