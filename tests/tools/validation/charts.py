"""The demo chart of the validation tests, with its packaged dependency built next to it.

Usage: chart = demo_chart(tmp_path)   # tmp_path/demo, whose charts/ holds packaged-2.0.0.tgz besides the
                                      # fixture's own unpacked sidecar dependency
"""

from __future__ import annotations

import shutil
import tarfile
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def demo_chart(work: Path) -> Path:
    """Copy the demo chart to work/demo and add a dependency shipped as an archive, as `helm dependency
    build` leaves one: packaged 2.0.0, whose template reads .Values.flag and .Values.more.deep."""
    chart = work / "demo"
    shutil.copytree(FIXTURES / "demo-chart", chart)
    packaged = work / "src" / "packaged"
    (packaged / "templates").mkdir(parents=True)
    (packaged / "Chart.yaml").write_text("apiVersion: v2\nname: packaged\nversion: 2.0.0\n")
    (packaged / "values.yaml").write_text("flag: true\n")
    (packaged / "templates" / "cm.yaml").write_text("x: {{ .Values.flag }} {{ .Values.more.deep }}\n")
    with tarfile.open(chart / "charts" / "packaged-2.0.0.tgz", "w:gz") as tar:
        tar.add(packaged, arcname="packaged")
    return chart
