"""jaxalign's version, from the installed package's metadata (pyproject.toml's `version`, the one place it is
written): what `jaxalign --version` prints and golden files record."""

from importlib import metadata

try:
    __version__ = metadata.version("jaxalign")
except metadata.PackageNotFoundError:  # a source tree on sys.path that was never pip-installed
    __version__ = "unknown (not installed)"
