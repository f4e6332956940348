"""Stands in for ``python3 -m torch_xla.distributed._xrt_run_server``: its command line carries
the name, and it waits until it is stopped (at most the given seconds)."""

import sys
import time

time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 300)
