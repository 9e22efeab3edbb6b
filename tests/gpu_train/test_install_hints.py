"""Every install command the project gives works from the checkout: the hints of gpu_train.spec.install name extras
pyproject.toml has, and README.md and docs/*.md install only this project's extras (`pip install ".[x]"`, `-e
".[x]"`) or pinned packages, never a distribution named after the project, which no index publishes.

Run: .venv/bin/pytest tests/gpu_train/test_install_hints.py -q
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest

from gpu_train.spec.install import EXTRAS, install_hint

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A pip install command, up to the end of its line, a comment or a closing backtick.
PIP = re.compile(r"pip install ([^`#\n]*)")


def pyproject_extras() -> tuple[str, ...]:
    return tuple(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])


def test_the_extras_are_pyprojects():
    assert pyproject_extras() == EXTRAS


def test_a_hint_is_pips_form_for_the_checkout():
    assert install_hint("serve-local") == 'pip install ".[serve-local]" from the gpu-train checkout'
    assert install_hint("cli", "sweeps") == 'pip install ".[cli,sweeps]" from the gpu-train checkout'
    with pytest.raises(ValueError, match="no such extra"):
        install_hint("serve_local")


def installs(text: str) -> list[str]:
    """The arguments of every `pip install` in a document (options and their values left out)."""
    out = []
    for match in PIP.finditer(text):
        args = shlex.split(match.group(1).split("&&")[0].split("|")[0])
        skip = False
        for arg in args:
            if skip:
                skip = False
            elif arg in ("--index-url", "-i", "--python", "-r", "-c"):
                skip = True
            elif not arg.startswith("-"):
                out.append(arg)
    return out


def test_every_install_command_in_the_docs_names_a_real_extra_or_a_pinned_package():
    seen = []
    for doc in DOCS:
        for arg in installs(doc.read_text()):
            seen.append(arg)
            where = f"{doc.relative_to(ROOT)}: pip install {arg}"
            match = re.fullmatch(r"\.\[([a-z,-]+)\]", arg)
            if match:
                unknown = set(match.group(1).split(",")) - set(pyproject_extras())
                assert not unknown, f"{where}: no such extra {sorted(unknown)}"
            else:  # a package from the index: pinned, and never this project
                name = re.split(r"[=<>\[]", arg)[0]
                assert "==" in arg and name not in ("gpu-train", "gpu_train"), where
    assert '.[cli]' in seen and '.[trainer,cli,sweeps]' in seen and '.[serve-local]' in seen


def test_the_scan_catches_a_distribution_from_the_index():
    assert installs('`pip install "gpu-train[serve]"` and pip install -e ".[dev]"') == ["gpu-train[serve]", ".[dev]"]
