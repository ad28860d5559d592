"""jaxalign's version (what golden files record and `jaxalign --version` prints)."""

__version__ = "0.1.0"
