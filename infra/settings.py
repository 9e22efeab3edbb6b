"""The stack's settings inside the Pulumi program: read once from the engine into gpu_train.spec's models.

Usage (infra/__main__.py): `settings = infra.settings.load()` -> StackSettings whose values all have their types
and ranges, or SettingsError naming every bad key. The models and docs/configuration.md live in
gpu_train/spec/settings.py; the checks across settings, the cloud's own and the job's fit then run together
(infra/clouds.py), before anything is created.
"""

from __future__ import annotations

from gpu_train.spec.settings import StackSettings, read


def load() -> StackSettings:
    """This stack's settings from the Pulumi engine (inside `pulumi up/preview` or under mocks)."""
    import pulumi
    from pulumi.runtime import config as runtime_config

    raw = dict(runtime_config.get_config_env())
    raw.update(runtime_config.CONFIG.get())
    return read(raw).model_copy(update={"stack": pulumi.get_stack()})
