"""The model registry's side of serving (MLflow): which version a reference means, where its files are, which run
trained it, and the aliases and tags that move with every decision.

Usage:
    registry = MlflowRegistry()                           # MLFLOW_TRACKING_URI, or tracking_uri=
    version = registry.resolve(ModelRef.parse("tiny@champion"))   # ServedVersion(3, run_id, source)
    registry.lineage(version.run_id)                      # the run's dataset, commit, image and parameters
    registry.deployed("tiny", 3, service="research/chat") # champion -> 3
    registry.canary_started("tiny", 4, ...)               # challenger -> 4
    registry.decided("tiny", 4, stable=3, decision=d, ...)  # promoted: champion -> 4; either way challenger goes

Aliases (https://mlflow.org/docs/latest/ml/model-registry/): `champion` is the version serving all of a
service's traffic, `challenger` the one on trial. Each decision also tags the canary's version with
`serving.decision` (promoted | rolled_back), `serving.reason`, `serving.metrics` (the numbers it was made on, as
JSON), `serving.service` and `serving.decided_at`, so the registry keeps why a version did or did not ship.
Every served version's InferenceService names its MLflow run (gpu_train.jobs.serving), whose tags and
parameters hold the dataset, the code and the settings it was trained with (trainer/tracking.py).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.artifacts import download_artifacts
from mlflow.exceptions import MlflowException

from gpu_train.jobs.serving import ServedVersion
from gpu_train.serving.canary import Decision
from gpu_train.spec.serving import CHALLENGER, CHAMPION, ModelRef

# MLflow refuses model-version tag values longer than this (mlflow/utils/validation.py, 3.17).
MAX_TAG = 5000
# Run tags and parameters that say where a version came from (trainer/tracking.py writes them).
LINEAGE_TAGS = ("dataset.uri", "dataset.manifest_sha256", "mlflow.source.git.commit", "trainer.image_digest",
                "checkpoint.latest_uri")


class RegistryError(RuntimeError):
    """The registry does not have what was asked for; the message names the model and the tracking server."""


class MlflowRegistry:
    def __init__(self, tracking_uri: str | None = None) -> None:
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.uri = self.client.tracking_uri

    def _fail(self, what: str, exc: MlflowException) -> RegistryError:
        return RegistryError(f"{what} (MLflow at {self.uri}: {exc.message.splitlines()[0]})")

    def resolve(self, ref: ModelRef) -> ServedVersion:
        """The version a reference means now, the run that trained it and where its files are."""
        try:
            if ref.version is not None:
                mv = self.client.get_model_version(ref.name, str(ref.version))
            elif ref.alias is not None:
                mv = self.client.get_model_version_by_alias(ref.name, ref.alias)
            else:
                found = self.client.search_model_versions(f"name = '{ref.name}'")
                if not found:
                    raise RegistryError(f"model {ref.name!r} has no versions in the registry at {self.uri}")
                mv = max(found, key=lambda v: int(v.version))
            source = self.client.get_model_version_download_uri(mv.name, mv.version)
        except MlflowException as exc:
            raise self._fail(f"model {ref} is not in the registry", exc) from None
        return ServedVersion(version=int(mv.version), run_id=mv.run_id or "", source=source)

    def lineage(self, run_id: str) -> dict[str, Any]:
        """Where a version came from: its run's lineage tags and how many parameters it recorded."""
        try:
            run = self.client.get_run(run_id)
        except MlflowException as exc:
            raise self._fail(f"run {run_id} is not in the tracking server", exc) from None
        return {"runId": run_id, "experimentId": run.info.experiment_id, "runName": run.info.run_name,
                **{k: run.data.tags[k] for k in LINEAGE_TAGS if k in run.data.tags},
                "params": len(run.data.params)}

    def download(self, version: ServedVersion, dest: Path) -> Path:
        """The version's files in `dest` (for serving on this machine)."""
        try:
            return Path(download_artifacts(artifact_uri=version.source, dst_path=str(dest),
                                           tracking_uri=self.uri))
        except MlflowException as exc:
            raise self._fail(f"cannot download {version.source}", exc) from None

    def aliases(self, model: str) -> dict[str, int]:
        try:
            return {a: int(v) for a, v in self.client.get_registered_model(model).aliases.items()}
        except MlflowException as exc:
            raise self._fail(f"model {model!r} is not in the registry", exc) from None

    def _tag(self, model: str, version: int, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_model_version_tag(model, str(version), key, value[:MAX_TAG])

    def _drop_alias_if(self, model: str, alias: str, version: int) -> None:
        if self.aliases(model).get(alias) == version:
            self.client.delete_registered_model_alias(model, alias)

    def deployed(self, model: str, version: int, service: str) -> None:
        self.client.set_registered_model_alias(model, CHAMPION, str(version))
        self._drop_alias_if(model, CHALLENGER, version)
        self._tag(model, version, {"serving.service": service, "serving.deployed_at": _now()})

    def canary_started(self, model: str, version: int, service: str) -> None:
        self.client.set_registered_model_alias(model, CHALLENGER, str(version))
        self._tag(model, version, {"serving.service": service, "serving.canary_started_at": _now()})

    def decided(self, model: str, version: int, stable: int, decision: Decision, service: str) -> None:
        """A canary's end: `champion` moves to a promoted version; the challenger alias goes either way."""
        if decision.action == "promote":
            self.client.set_registered_model_alias(model, CHAMPION, str(version))
        self._drop_alias_if(model, CHALLENGER, version)
        self._tag(model, version, {
            "serving.decision": "promoted" if decision.action == "promote" else "rolled_back",
            "serving.reason": decision.reason, "serving.metrics": json.dumps(decision.metrics, sort_keys=True),
            "serving.stable_version": str(stable), "serving.service": service, "serving.decided_at": _now()})


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
