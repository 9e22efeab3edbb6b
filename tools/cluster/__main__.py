"""python -m tools.cluster up|down|status: the local control plane (tools/cluster/plane.py)."""

import sys

from tools.cluster.plane import main

sys.exit(main())
