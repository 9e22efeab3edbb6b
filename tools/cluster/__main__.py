"""python -m tools.cluster up|down|status: the local control plane (tools/cluster/plane.py).

    up       build what is missing (tools/cluster/build.sh), start, wait until ready, print the admin KUBECONFIG
    down     stop every process and remove the run directory
    status   the running plane's processes; exit 1 if none runs or one has exited
"""

from __future__ import annotations

import json
import sys

from tools.cluster.plane import Plane


def main(argv: list[str] | None = None) -> int:
    cmd = (argv if argv is not None else sys.argv[1:]) or ["status"]
    if cmd[0] == "up":
        plane = Plane.start()
        state = json.loads((plane.run / "state.json").read_text())
        print(f"local control plane ready in {state['ready_s']} s at {plane.server}")
        print(f"export KUBECONFIG={plane.admin_kubeconfig}")
        return 0
    if cmd[0] in ("down", "status"):
        plane = Plane.load()
        if plane is None:
            print("no local control plane runs")
            return 0 if cmd[0] == "down" else 1
        if cmd[0] == "down":
            plane.stop()
            print("local control plane stopped")
            return 0
        alive = plane.alive()
        print(f"{plane.server}  KUBECONFIG={plane.admin_kubeconfig}")
        for name, up in alive.items():
            print(f"  {name:24} {'running' if up else 'EXITED'}")
        return 0 if all(alive.values()) else 1
    print("usage: python -m tools.cluster up|down|status", file=sys.stderr)
    return 2


sys.exit(main())
