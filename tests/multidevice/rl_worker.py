"""One process of the two-process RL test (tests/test_multiprocess.py): joins the job named by the
JAXALIGN_* environment variables, runs GRPO with the trainer mesh spanning both processes, stops after one step,
resumes from the orbax checkpoint in a fresh Trainer and finishes; writes its metric rows as JSON."""

import json
import sys

from jaxalign.distributed import initialize_from_env

assert initialize_from_env(), "JAXALIGN_COORDINATOR / _NUM_PROCESSES / _PROCESS_ID must be set"

import jax  # noqa: E402

from jaxalign.model.config import ModelConfig  # noqa: E402
from jaxalign.rl.sft import warm_start  # noqa: E402
from jaxalign.rl.trainer import Trainer  # noqa: E402

sys.path.insert(0, sys.argv[1])
from rl_settings import SFT, rl_config  # noqa: E402

cache, run_dir, out = sys.argv[2], sys.argv[3], sys.argv[4]
config = rl_config(trainer_mesh="data=2", steps=2)  # the two steps of tests/test_multiprocess.py's reference


def model():
    return warm_start(ModelConfig.preset("countdown"), SFT, cache, progress=False)


first = Trainer(model(), config, run_dir)
first.run(progress=False, stop_after=1)  # checkpoints after step 1
resumed = Trainer(model(), config, run_dir)  # as a restarted job would
rows = resumed.run(progress=False)
with open(out, "w") as f:
    json.dump({"process": jax.process_index(), "devices": jax.device_count(), "rows": rows}, f)
