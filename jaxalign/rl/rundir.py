"""Run directories you can trust: what produced a run is recorded, and metrics survive a SIGKILL.

`claim(run_dir, record)` writes `run.json` -- the run's settings, the code fingerprint (`code_fingerprint`:
jaxalign's source and the JAX/jaxlib versions), a hash of the starting weights and the host (backend, versions,
CPU model and the instruction set XLA:CPU generates code for). On a directory that already has one it compares:
other settings, another build or other starting weights refuse with an error that lists every difference (the
old run's numbers are never reported as the new run's); another host only warns, naming what differs, because
the float bits of a resumed run may then depend on where each part ran.

`MetricsLog` appends one JSON line per step and fsyncs it before the step's checkpoint is written; on resume it
keeps exactly the rows up to the restored step (dropping rows of steps that will be recomputed and a torn last
line) and rewrites the file atomically. So after a SIGKILL at any moment, running the same command again leaves
every step exactly once, and the file is byte-identical to an uninterrupted run's (wall-clock times go to
`timing.jsonl`, which is not part of that promise).

`hold(run_dir)` makes a directory one process's at a time: an exclusive `flock` on `run_dir/.lock`, taken before
anything in the directory is read or written, so a second command on the same `--out` is refused (`RunDirBusy`,
naming the holder's pid, host, start time and command) instead of interleaving its rows and checkpoints with the
first's. The kernel releases the lock when its holder exits, however it exits (SIGKILL included), so a killed run
never leaves the directory stuck; the holder's details in the file are only a message, never trusted as the lock.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import socket
import sys
import threading
import time
import warnings

import numpy as np

from jaxalign.numerics.platforms import cpu_model_and_flags, effective_isa

RUN_FILE = "run.json"
LOCK_FILE = ".lock"
_RECORD_KEYS = ("settings", "code", "start_weights")  # must match to continue a run


class RunMismatch(ValueError):
    """An existing run directory was produced by other settings, another build or other starting weights."""


class RunDirBusy(ValueError):
    """The run directory is held by another process (`hold`): a usage error, as the command line reports it."""


_held: dict[str, list] = {}  # real path -> [open lock file, holds]: this process's locks (a hold is reentrant)
_held_guard = threading.Lock()


class _Hold:
    """One hold of a run directory; `release()` (or leaving the `with` block) gives it back, once."""

    def __init__(self, key: str):
        self.key, self._released = key, False

    def release(self) -> None:
        """Give this hold back; the lock is released when this process's last hold on the directory is."""
        with _held_guard:
            if self._released:
                return
            self._released = True
            entry = _held[self.key]
            entry[1] -= 1
            if entry[1] == 0:
                del _held[self.key]
                entry[0].close()  # closing the descriptor releases the flock

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def hold(run_dir: str, *, what: str = "run") -> _Hold:
    """Take `run_dir` for this process (see the module docstring), creating it if needed; `RunDirBusy` naming
    the holder when another process has it. Reentrant within a process (a study holds its directory while its
    trainers hold theirs), so only other processes are refused."""
    os.makedirs(run_dir, exist_ok=True)
    key = os.path.realpath(run_dir)
    with _held_guard:
        if key in _held:
            _held[key][1] += 1
            return _Hold(key)
        handle = open(os.path.join(run_dir, LOCK_FILE), "a+")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process (starting)"
            handle.close()
            raise RunDirBusy(f"{run_dir} is in use by {holder}: two commands on one output directory would "
                             f"write the same rows and checkpoints; wait for it to finish (a killed holder "
                             f"releases it at once) or choose another directory for this {what}") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()} since "
                     f"{time.strftime('%Y-%m-%d %H:%M:%S')} ({' '.join(sys.argv)[:300]})\n")
        handle.flush()
        _held[key] = [handle, 1]
        return _Hold(key)


def host_info() -> dict:
    """Backend, device kind, jax/jaxlib versions, CPU model and effective ISA of this process."""
    import jax
    import jaxlib
    return {"backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind,
            "device_count": jax.device_count(), "process_count": jax.process_count(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "cpu": cpu_model_and_flags()[0], "isa": effective_isa()}


def weights_fingerprint(tree) -> str:
    """A hash of every leaf's dtype, shape and bytes (in tree order); 'multi-process' where leaves are not all
    on this host."""
    import jax
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(tree):
        if not getattr(leaf, "is_fully_addressable", True):
            return "multi-process"
        array = np.asarray(leaf)
        digest.update(f"{array.dtype}{array.shape}".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    return digest.hexdigest()[:16]


@functools.lru_cache(maxsize=None)
def code_fingerprint() -> str:
    """A hash of jaxalign's Python source and the JAX/jaxlib versions: anything that can change the float bits
    of a training run. (A warm start cached by another build once silently replaced what this build trains.)"""
    import jax
    import jaxlib
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256(f"jax {jax.__version__} jaxlib {jaxlib.__version__}".encode())
    for folder, _, files in sorted(os.walk(root)):  # every folder, in path order
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            digest.update(os.path.relpath(path, root).encode())
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()[:16]


def make_record(settings: dict, start_weights: str = "") -> dict:
    """What `run.json` holds for a run with these (JSON-ready) settings."""
    return {"settings": json.loads(json.dumps(settings)), "code": code_fingerprint(),
            "start_weights": start_weights, "host": host_info()}


def _differences(old, new, prefix="") -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new), key=str):
            name = f"{prefix}.{key}" if prefix else str(key)
            if key not in old:
                out.append(f"{name}: (absent) -> {new[key]!r}")
            elif key not in new:
                out.append(f"{name}: {old[key]!r} -> (absent)")
            else:
                out.extend(_differences(old[key], new[key], name))
        return out
    return [] if old == new else [f"{prefix}: {old!r} -> {new!r}"]


def claim(run_dir: str, record: dict, *, what: str = "run", write: bool = True) -> None:
    """Record `record` in `run_dir/run.json`, or check it against the one there (see the module docstring).
    A directory with results but no `run.json` is refused too (its provenance is unknown)."""
    path = os.path.join(run_dir, RUN_FILE)
    if not os.path.exists(path):
        leftovers = [n for n in ("metrics.jsonl", "checkpoints", "summary.json") if os.path.exists(
            os.path.join(run_dir, n))]
        if leftovers:
            raise RunMismatch(f"{run_dir} holds results ({', '.join(leftovers)}) but no {RUN_FILE}: they cannot be "
                              f"attributed to these settings; choose a new output directory")
        if write:
            os.makedirs(run_dir, exist_ok=True)
            _write_atomic(path, json.dumps(record, indent=2, sort_keys=True) + "\n")
        return
    with open(path) as f:
        old = json.load(f)
    diffs = [d for key in _RECORD_KEYS for d in _differences(old.get(key), record.get(key), key)]
    if diffs:
        raise RunMismatch(f"{run_dir} holds {what} results made with other settings or another build, which this "
                          f"command would report as its own; it differs in:\n  " + "\n  ".join(diffs) +
                          "\nchoose a new output directory (or delete this one) to run these settings")
    host_diffs = _differences(old.get("host"), record.get("host"), "host")
    if host_diffs:
        warnings.warn(f"{run_dir}: resuming a {what} started on another host ({'; '.join(host_diffs)}); steps "
                      f"after the resume ran here, so the run's bits may depend on both", stacklevel=2)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class MetricsLog:
    """`metrics.jsonl`: one line per step, durable before the step's checkpoint (see the module docstring)."""

    def __init__(self, path: str, writer: bool = True):
        self.path, self.writer = path, writer

    def resume(self, step: int) -> list[dict]:
        """The whole rows of steps 0, 1, ... up to `step` (the restored checkpoint's), stopping at the first row that
        is torn, unreadable or out of sequence; the file is rewritten to hold exactly those. Fewer than `step` + 1
        rows means the rows after them must be recomputed (the trainer goes back to an older state)."""
        lines = []
        if os.path.exists(self.path):
            with open(self.path) as f:
                for line in f:
                    if not line.endswith("\n"):
                        break  # torn by a kill mid-write (or cut later): that step is recomputed
                    try:
                        row_step = json.loads(line)["step"]
                    except (ValueError, KeyError, TypeError):
                        break
                    if row_step != len(lines) or row_step > step:
                        break
                    lines.append(line)
        if self.writer:
            _write_atomic(self.path, "".join(lines))
        return [json.loads(line) for line in lines]

    def append(self, row: dict) -> None:
        """Write one row and make it durable."""
        if not self.writer:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())


def finished_rows(run_dir: str, steps: int) -> list[dict] | None:
    """A finished run's metrics rows (its `metrics.jsonl` reaches step `steps`, every line whole and the steps
    0..steps each once), read without building anything; None for a run that is missing or unfinished. A study
    committed without checkpoints is read (and skipped by a resumed study) through this."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path) or not os.path.exists(os.path.join(run_dir, "run.json")):
        return None
    with open(path) as f:
        text = f.read()
    if not text.endswith("\n"):
        return None
    try:
        rows = [json.loads(line) for line in text.splitlines()]
        return rows if [r["step"] for r in rows] == list(range(steps + 1)) else None
    except (ValueError, KeyError, TypeError):  # a damaged line: the run is resumed (and that step recomputed)
        return None
