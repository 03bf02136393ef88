"""`python -m dsv4.bench ARGS` runs `dsv4 bench ARGS`."""

import sys

from dsv4.bench import main

sys.exit(main(prog="python -m dsv4.bench"))
