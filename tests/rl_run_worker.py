"""One RL run as a separate process (tests/test_rl_trainer.py kills it with SIGKILL and runs it again, synchronous
and at max_lag 2, and starts two at once on one directory): the warm start from the test's cache,
`rl_settings.rl_config(**json overrides)`, written into the run directory. Exits 2 with the message when the
directory is in use, as the command line does."""

import json
import sys

from jaxalign.model.config import ModelConfig
from jaxalign.rl.sft import warm_start
from jaxalign.rl.rundir import RunDirBusy, hold
from jaxalign.rl.trainer import Trainer

sys.path.insert(0, sys.argv[1])
from rl_settings import SFT, rl_config  # noqa: E402

cache, run_dir, overrides = sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
try:  # the directory first, as the command line takes it: a refused run loads nothing (no orbax threads to stop)
    held = hold(run_dir)
except RunDirBusy as err:
    print(err, file=sys.stderr)
    sys.exit(2)
model = warm_start(ModelConfig.preset("countdown"), SFT, cache, progress=False)
Trainer(model, rl_config(**overrides), run_dir).run(progress=False)
