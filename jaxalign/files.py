"""Reading the files a user hands jaxalign (checkpoint configs and weights, golden and candidate files, prompt
files): a missing, unreadable or garbled file is a `ValueError` naming the file and what was expected, never an
`OSError` or a parser's own exception (the `jaxalign` command reports it with exit code 2)."""

from __future__ import annotations

import contextlib
import json
from typing import Any, Iterator

from safetensors import SafetensorError, safe_open


def _unreadable(path: str, what: str, err: BaseException) -> ValueError:
    reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
    return ValueError(f"{path}: cannot read {what} ({reason})")


def read_text(path: str, what: str = "the file") -> str:
    """The UTF-8 text of `path`; ValueError naming it when it is missing, a directory, unreadable or not text."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except (OSError, UnicodeDecodeError) as err:
        raise _unreadable(path, what, err) from None


def read_lines(path: str, what: str = "the file") -> list[str]:
    """The lines of `path` (universal newlines, without their line ends); ValueError naming it as `read_text`."""
    return read_text(path, what).split("\n")


def read_json(path: str, what: str = "the JSON file") -> Any:
    """The JSON value in `path`; ValueError naming it when it is missing, unreadable or not valid JSON."""
    text = read_text(path, what)
    try:
        return json.loads(text)
    except ValueError as err:  # json.JSONDecodeError
        raise ValueError(f"{path}: {what} is not valid JSON ({err})") from None


@contextlib.contextmanager
def open_safetensors(path: str) -> Iterator[Any]:
    """`safe_open(path, framework="np")`; ValueError naming the file when it is missing, truncated or not a
    safetensors file. Errors raised by the caller's own code inside the block pass through unchanged."""
    try:
        handle = safe_open(path, framework="np")
    except (OSError, SafetensorError) as err:
        raise ValueError(f"{path}: not a readable safetensors file ({err})") from None
    with handle as f:
        yield f

