"""Stack plans made once per source tree and shared by every test process that asks for them.

Usage:
    folder = planned("aws-dev", ["--stack", "aws-dev"])   # holds aws-dev.json and aws-dev/ (k8s YAML)
    plan_stacks(["aws-dev", "aws-dev-serving"], out, stack_file=serving_or_none)   # both, side by side in `out`

`make test` runs the integration lane (two pytest-xdist workers) and the cluster lane at once, and each asks for
the plans of the same stacks. A plan is a pure function of the program's source, the stack file and the
installed packages, so each is made once, by whichever process asks first, under
build/test-plans/<key>/<name>/, while the others wait on its lock; the key hashes every file of the directories
the program reads, the Python version, every installed distribution's version and the environment's PULUMI_*
variables. A plan that fails is not kept. Only the newest KEEP keys are kept.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from filelock import FileLock

ROOT = Path(__file__).resolve().parent.parent
CACHE = ROOT / "build" / "test-plans"
# What `python -m infra.plan` reads of this repository.
SOURCES = ("infra", "gpu_train", "policies", "stacks", "tools", "trainer", "examples", "pyproject.toml", "Pulumi.yaml")
KEEP = 3
StackFile = Callable[[str, Path], Path | None]


@functools.cache
def source_key() -> str:
    h = hashlib.sha256(sys.version.encode())
    for top in SOURCES:
        base = ROOT / top
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file()
                                                      and "__pycache__" not in p.parts)
        for path in files:
            h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    for dist in sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()):
        h.update(dist.encode() + b"\n")
    for name in sorted(k for k in os.environ if k.startswith("PULUMI_")):
        h.update(f"{name}={os.environ[name]}\n".encode())
    return h.hexdigest()[:16]


def _prune() -> None:
    keys = sorted((p for p in CACHE.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime, reverse=True)
    for old in keys[KEEP:]:
        shutil.rmtree(old, ignore_errors=True)


def planned(name: str, args: list[str], stack_files: Mapping[str, str] | None = None) -> Path:
    """The folder holding `name`'s plan (`python -m infra.plan ARGS --out FOLDER`), made now unless this source tree
    has it. `stack_files`: files to write into the folder first ({file name: text}); `{folder}` in ARGS is the
    folder. AssertionError with the plan's output when it fails."""
    folder = CACHE / source_key() / name
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):
        if (folder / ".done").exists():
            return folder
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        for file_name, text in (stack_files or {}).items():
            (folder / file_name).write_text(text)
        argv = [a.replace("{folder}", str(folder)) for a in args]
        proc = subprocess.run([sys.executable, "-m", "infra.plan", *argv, "--out", str(folder), "--quiet"],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"planning {name} failed:\n{proc.stdout}\n{proc.stderr}"
        (folder / ".done").touch()
    _prune()
    return folder


def plan_stacks(names: Iterable[str], out: Path, stack_file: StackFile | None = None) -> None:
    """Each named plan in `out` (`out`/<name>.json, `out`/<name>/ and a variant's stack file, links to its planned
    folder's), two made at a time. `stack_file(name, folder)` writes the stack file of a name that is no stack of stacks/ (a variant) into
    `folder` and returns its path; None for a stack of stacks/."""
    def plan(name: str) -> Path:
        with tempfile.TemporaryDirectory() as tmp:
            made = stack_file(name, Path(tmp)) if stack_file else None
            if made is None:
                return planned(name, ["--stack", name])
            return planned(name, ["--stack-file", f"{{folder}}/{made.name}"], {made.name: made.read_text()})

    names = list(names)
    with ThreadPoolExecutor(max_workers=2) as pool:
        for name, folder in zip(names, pool.map(plan, names), strict=True):
            made = [p.name for p in folder.glob("Pulumi.*.yaml")]  # a variant's stack file, which tests read too
            for entry in (f"{name}.json", name, *made):
                (out / entry).symlink_to(folder / entry)
