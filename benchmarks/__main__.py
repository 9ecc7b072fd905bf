"""``python -m benchmarks``: see :mod:`benchmarks.run`.

OpenMP threads that busy-wait (libgomp's default) make every small parallel
torch operation stall for milliseconds while other processes hold the cores,
which on a shared machine turns ratios into noise (nvalchemi's masked step went
from under 1 ms to about 40 ms per step on a loaded 2-core CPU). The wait
policy is read once, when torch loads OpenMP, so it is set here before any
import: passive unless the caller set ``OMP_WAIT_POLICY`` (the report says
which).
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from benchmarks.run import main

raise SystemExit(main())
