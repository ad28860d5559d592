"""`python -m jaxalign.engines.vllm install [--force]`: the same as `jaxalign vllm install`."""

import sys

from jaxalign.cli import main

if __name__ == "__main__":
    sys.exit(main(["vllm", *sys.argv[1:]]))
