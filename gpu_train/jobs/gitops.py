"""Jobs from git: which spec files a folder holds, what must change on the cluster to match them, and whether a
live JobSet was edited by hand. Pure functions; `gpu-train lint` and `gpu-train apply` (gpu_train/cli/gitops.py)
do the reading, the API calls and the printing.

Usage:
    files, problems = spec_files(Path("jobs"))          # jobs/<team>/<name>.yaml, file-level problems named
    problems += file_problems("jobs/research/a.yaml", "research", raw)   # team folder and file name vs the spec
    actions = plan(desired, live, prune=True, replace_running=False)     # desired: {name: rendered JobSet}

The rule for a JobSet whose spec changed (docs/gitops.md): JobSet keeps its replicated jobs immutable (the
validating webhook of jobset v0.12.0 allows only the pod template's labels, annotations, node selector, tolerations
and scheduling gates to change, and only while suspended), so a change is always delete + create. That is safe
while the JobSet holds no running pods: Kueue has not admitted it (`spec.suspend` true: queued, paused or evicted)
or it has finished (Completed or Failed). A running JobSet is left as it is and reported as a pending change
unless `--replace-running`: then its pods get SIGTERM, write a final checkpoint within the grace period, and the
new JobSet resumes from it. Reverting the commit brings the spec back to the running one's hash, and the pending
change disappears.

Drift: an apply whose spec is unchanged (equal config hash, so the rendering it would send equals what it sent)
compares every field the renderer sets with the live JobSet; a field with another value, or gone, is drift. Fields
the cluster adds (defaults, Kueue's scheduling additions) are not drift; `spec.suspend` belongs to Kueue. Drift is
reported, never overwritten: cancel the JobSet (`gpu-train cancel`) and the next apply creates it again, or change
the spec in git.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_train.jobs.jobset import (
    COMMIT_ANNOTATION,
    HASH_ANNOTATION,
    MANAGED_ANNOTATION,
    MANAGED_BY_APPLY,
    PATH_ANNOTATION,
)

SPEC_SUFFIXES = (".yaml", ".yml")
TEAM_FOLDER = re.compile(r"[a-z]([-a-z0-9]{0,30}[a-z0-9])?")
# Pod template fields Kueue may add to on admission (lists it appends to): compared as "contains".
KUEUE_LISTS = ("tolerations", "schedulingGates")
# Not drift: Kueue owns spec.suspend; the provenance annotations say where the JobSet came from, and an unchanged
# spec at a later commit keeps the commit it was created at.
NOT_DRIFT = frozenset({"spec.suspend", *(f"metadata.annotations.{key}" for key in (
    HASH_ANNOTATION, PATH_ANNOTATION, COMMIT_ANNOTATION))})


def spec_files(root: Path) -> tuple[list[tuple[Path, str]], list[str]]:
    """(spec file, team) for every `<team>/<name>.yaml` under `root` (a jobs folder, a team folder or one file),
    and a problem for each file that is not where a spec belongs."""
    root = Path(root)
    if root.is_file():
        return [(root, root.parent.name)], []
    if not root.is_dir():
        return [], [f"{root}: no such file or folder"]
    teams = [root] if any(p.suffix in SPEC_SUFFIXES for p in root.iterdir() if p.is_file()) else \
        sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    found, problems = [], []
    for folder in teams:
        for path in sorted(folder.iterdir()):
            if path.name.startswith("."):
                continue
            if path.is_dir():
                problems.append(f"{path}: a jobs folder holds <team>/<name>.yaml files only")
            elif path.suffix not in SPEC_SUFFIXES:
                problems.append(f"{path}: not a job spec (<name>.yaml)")
            else:
                found.append((path, folder.name))
    return found, problems


def file_problems(source: str, team_folder: str, raw: Mapping[str, Any]) -> list[str]:
    """The spec's team and name against where the file is: jobs/<team>/<name>.yaml."""
    p = []
    name, team = raw.get("name"), raw.get("team")
    stem = Path(source).stem
    if not TEAM_FOLDER.fullmatch(team_folder):
        p.append(f"{source}: folder {team_folder!r} is not a team name (jobs/<team>/<name>.yaml)")
    if team != team_folder:
        p.append(f"{source}: job.team {team!r} does not match its folder {team_folder!r} (jobs/<team>/<name>.yaml)")
    if name != stem:
        p.append(f"{source}: job.name {name!r} does not match the file name {stem!r} (jobs/<team>/<name>.yaml)")
    return p


def duplicate_problems(entries: Sequence[tuple[str, str, str]]) -> list[str]:
    """(source, team, name) of every spec: one job name twice in a team (a.yaml and a.yml) is refused."""
    seen: dict[tuple[str, str], str] = {}
    p = []
    for source, team, name in entries:
        if (team, name) in seen:
            p.append(f"{source}: job {name!r} of team {team!r} is also defined in {seen[(team, name)]}")
        else:
            seen[(team, name)] = source
    return p


# ------------------------------------------------------------------------------------------------ live state


def annotations(obj: Mapping[str, Any]) -> Mapping[str, str]:
    return (obj.get("metadata") or {}).get("annotations") or {}


def managed(obj: Mapping[str, Any]) -> bool:
    """Created by `gpu-train apply` (the only JobSets apply replaces or prunes)."""
    return annotations(obj).get(MANAGED_ANNOTATION) == MANAGED_BY_APPLY


def finished(obj: Mapping[str, Any]) -> bool:
    return any(c.get("type") in ("Completed", "Failed") and c.get("status") == "True"
               for c in (obj.get("status") or {}).get("conditions") or [])


def holds_pods(obj: Mapping[str, Any]) -> bool:
    """Admitted by Kueue and not finished: replacing it would stop running pods."""
    return (obj.get("spec") or {}).get("suspend") is not True and not finished(obj)


def drift(desired: Any, live: Any, path: str = "") -> list[str]:
    """The paths of fields the renderer sets that the live object lacks or holds another value in."""
    if isinstance(desired, Mapping):
        if not isinstance(live, Mapping):
            return [path or "."]
        out = []
        for key, value in desired.items():
            where = f"{path}.{key}" if path else key
            if where in NOT_DRIFT:
                continue
            if key not in live:
                out.append(where)
            elif key in KUEUE_LISTS and isinstance(value, list):
                out += [f"{where}[{i}]" for i, item in enumerate(value) if item not in (live[key] or [])]
            else:
                out += drift(value, live[key], where)
        return out
    if isinstance(desired, list):
        if not isinstance(live, list) or len(live) != len(desired):
            return [path]
        return [p for i, (d, v) in enumerate(zip(desired, live, strict=True)) for p in drift(d, v, f"{path}[{i}]")]
    return [] if desired == live else [path]


@dataclass(frozen=True)
class Action:
    """One thing apply does or reports. kind: create, unchanged, replace, pending (a running JobSet whose spec
    changed), cancel (pruned), orphan (its spec is gone; kept without --prune), drift, conflict (a JobSet of that
    name that apply did not create)."""

    kind: str
    name: str
    reason: str = ""
    manifest: Mapping[str, Any] | None = None

    @property
    def writes(self) -> bool:
        return self.kind in ("create", "replace", "cancel")


def plan(desired: Mapping[str, Mapping[str, Any]], live: Sequence[Mapping[str, Any]], *, prune: bool,
         replace_running: bool) -> list[Action]:
    """What to do so that the team's namespace matches its spec files (module docstring: the rule)."""
    by_name = {obj["metadata"]["name"]: obj for obj in live}
    actions = []
    for name, manifest in sorted(desired.items()):
        current = by_name.get(name)
        if current is None:
            actions.append(Action("create", name, "new spec", manifest))
        elif not managed(current):
            actions.append(Action("conflict", name, "a JobSet of this name exists that `gpu-train apply` did not "
                                  "create (submitted by hand?): cancel it or rename the spec", manifest))
        elif annotations(current).get(HASH_ANNOTATION) == annotations(manifest).get(HASH_ANNOTATION):
            fields = drift(manifest, current)
            actions.append(Action("drift", name, "edited on the cluster: " + ", ".join(fields[:5])
                                  + (f" (+{len(fields) - 5} more)" if len(fields) > 5 else ""), manifest)
                           if fields else Action("unchanged", name, "", manifest))
        elif holds_pods(current) and not replace_running:
            actions.append(Action("pending", name, "spec changed but the job is running; it keeps running as it is "
                                  "(--replace-running replaces it: final checkpoint, then the new spec resumes)",
                                  manifest))
        else:
            why = "finished" if finished(current) else ("running; --replace-running" if holds_pods(current)
                                                        else "not admitted by Kueue")
            actions.append(Action("replace", name, f"spec changed ({why})", manifest))
    for name, current in sorted(by_name.items()):
        if name in desired or not managed(current):
            continue
        actions.append(Action("cancel", name, "its spec was deleted") if prune else
                       Action("orphan", name, "its spec was deleted; --prune cancels it"))
    return actions
