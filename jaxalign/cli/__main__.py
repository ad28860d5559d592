"""`python -m jaxalign.cli`: the `jaxalign` command."""

import sys

from jaxalign.cli import main

sys.exit(main())
