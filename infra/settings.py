"""The stack's settings inside the Pulumi program: read once from the engine into gpu_train.spec's models.

Usage (infra/__main__.py): `settings = infra.settings.load()` -> StackSettings, or SettingsError naming every bad
key. The models, their checks and docs/configuration.md live in gpu_train/spec/settings.py; the checks that belong
to one cloud run in that cloud's layer (infra/aws/settings_checks.py, infra/gcp/settings_checks.py) before it
creates anything.
"""

from __future__ import annotations

from gpu_train.spec.settings import StackSettings, parse


def load() -> StackSettings:
    """This stack's settings from the Pulumi engine (inside `pulumi up/preview` or under mocks)."""
    import pulumi
    from pulumi.runtime import config as runtime_config

    raw = dict(runtime_config.get_config_env())
    raw.update(runtime_config.CONFIG.get())
    return parse(raw, stack=pulumi.get_stack())
