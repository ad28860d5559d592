"""The small GRPO run shared by the trainer, mesh and two-process tests (one definition, so runs compare)."""

import json
import os

from jaxalign.rl.correction import CorrectionConfig
from jaxalign.rl.grpo import GRPOConfig
from jaxalign.rl.sft import SFTConfig
from jaxalign.rl.trainer import RLConfig

SFT = SFTConfig(problems=300, steps=30)

# A directory holding `rows.json` (one_device_rows' result for `rl_config()`) and the SFT cache it began from:
# tests/test_meshes.py sets it for the multidevice suite's RL run on a mesh
RL_REFERENCE_ENV = "JAXALIGN_RL_ONE_DEVICE_REFERENCE"


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


def one_device_rows(work_dir: str, **overrides) -> list[dict]:
    """The metric rows (timing stripped, as JSON gives them back) of `rl_config(**overrides)` on one device, from
    the SFT warm start cached in `work_dir/sft` (trained there first if absent); the run itself goes to
    `work_dir/one`. A process with one device runs it with the programs the trainer tests compile (the suite's
    persistent compilation cache has them), where a process with fake devices would compile them for its own
    device count again."""
    from jaxalign.model.config import ModelConfig
    from jaxalign.rl.sft import warm_start
    from jaxalign.rl.trainer import Trainer
    model = warm_start(ModelConfig.preset("countdown"), SFT, os.path.join(work_dir, "sft"), progress=False)
    rows = Trainer(model, rl_config(**overrides), os.path.join(work_dir, "one")).run(progress=False)
    return json.loads(json.dumps(strip_timing(rows)))
