"""The small GRPO run shared by the trainer, mesh and two-process tests (one definition, so runs compare)."""

import json
import os

from jaxalign.rl.correction import CorrectionConfig
from jaxalign.rl.grpo import GRPOConfig
from jaxalign.rl.sft import SFTConfig
from jaxalign.rl.trainer import RLConfig

SFT = SFTConfig(problems=300, steps=30)

# Set by tests/test_meshes.py for the multidevice suite: a directory `save_one_device_reference` filled
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


def comparable_rows(rows) -> list[dict]:
    """Metric rows without timing, as JSON gives them back: the form runs in different processes compare in."""
    return json.loads(json.dumps(strip_timing(rows)))


def sft_cache(work_dir: str) -> str:
    """Where `one_device_rows(work_dir)` keeps the SFT warm start it began from (another run loads it there)."""
    return os.path.join(work_dir, "sft")


def one_device_rows(work_dir: str, **overrides) -> list[dict]:
    """`comparable_rows` of `rl_config(**overrides)` run on one device from the warm start in `sft_cache(work_dir)`
    (trained there first if absent); the run itself goes to `work_dir/one`. A process with one device runs it
    with the programs the trainer tests compile (the suite's persistent compilation cache has them), where a
    process with fake devices would compile them for its own device count again."""
    from jaxalign.model.config import ModelConfig
    from jaxalign.rl.sft import warm_start
    from jaxalign.rl.trainer import Trainer
    model = warm_start(ModelConfig.preset("countdown"), SFT, sft_cache(work_dir), progress=False)
    return comparable_rows(Trainer(model, rl_config(**overrides), os.path.join(work_dir, "one")).run(progress=False))


def save_one_device_reference(work_dir: str) -> dict[str, str]:
    """Run `one_device_rows(work_dir)` for `rl_config()` and keep its rows there; the environment a child process
    reads them back with (`one_device_reference`)."""
    with open(os.path.join(work_dir, "rows.json"), "w") as f:
        json.dump(one_device_rows(work_dir), f)
    return {RL_REFERENCE_ENV: work_dir}


def one_device_reference(fallback_dir: str) -> tuple[list[dict], str]:
    """(rows, SFT cache) of `rl_config()` on one device: those `save_one_device_reference` kept for this process,
    or, without them, `one_device_rows(fallback_dir)` run here."""
    work = os.environ.get(RL_REFERENCE_ENV)
    if not work:
        return one_device_rows(fallback_dir), sft_cache(fallback_dir)
    with open(os.path.join(work, "rows.json")) as f:
        return json.load(f), sft_cache(work)
