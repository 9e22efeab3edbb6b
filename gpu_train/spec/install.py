"""What to install for a part of gpu-train: the one place a hint (`pip install ".[serve-local]"`) is formatted.

Usage:
    from gpu_train.spec.install import install_hint
    raise ClientError(f"`gpu-train serve --local` needs torch: {install_hint('serve-local')}")

gpu-train is installed from its checkout, not from a package index (no distribution of that name is published),
so every hint is pip's form for the project in the current directory with its extras: `pip install ".[a,b]"`.
EXTRAS names the optional dependency groups of pyproject.toml ([project.optional-dependencies]); a test holds
the two the same, and a hint naming any other extra fails when it is formatted, so no hint can name one that
does not exist.
"""

from __future__ import annotations

# pyproject.toml's [project.optional-dependencies], in its order (tests/gpu_train/test_install_hints.py).
EXTRAS = ("trainer", "infra", "cli", "serve", "serve-local", "examples", "sweeps", "prep", "dev")


def install_hint(*extras: str) -> str:
    """`pip install ".[extra,...]"`: the command that installs these extras from the checkout."""
    unknown = [e for e in extras if e not in EXTRAS]
    if not extras or unknown:
        raise ValueError(f"no such extra {unknown or list(extras)} (extras: {', '.join(EXTRAS)})")
    return f'pip install ".[{",".join(extras)}]" from the gpu-train checkout'
