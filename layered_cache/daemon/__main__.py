"""``python -m layered_cache.daemon --config FILE`` (same as ``layered-cache daemon``)."""

import sys

from layered_cache.daemon.main import main

sys.exit(main(prog="python -m layered_cache.daemon"))
