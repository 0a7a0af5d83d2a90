"""``python -m consumers --config FILE``: the daemon, from a source checkout."""

import sys

from layered_cache.daemon.main import main

sys.exit(main(prog="python -m consumers"))
