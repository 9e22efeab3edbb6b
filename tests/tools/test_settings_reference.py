"""docs/configuration.md's tables are the settings models' own keys, types, defaults and descriptions.

Run: .venv/bin/pytest tests/tools/test_settings_reference.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

from gpu_train.spec.settings import StackSettings
from tools import settings_reference

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_documented_tables_are_the_models(capsys):
    assert settings_reference.main(["--check", str(DOC)]) == 0, capsys.readouterr().err


def test_a_table_out_of_date_is_caught(tmp_path):
    stale = tmp_path / "configuration.md"
    stale.write_text(DOC.read_text().replace("| `maxNodes` | int >= 1 | required |", "| `maxNodes` | int | required |"))
    assert settings_reference.main(["--check", str(stale)]) == 1
    assert settings_reference.main(["--write", str(stale)]) == 0
    assert stale.read_text() == DOC.read_text()


def test_every_setting_has_a_table_and_a_description():
    text = DOC.read_text()
    assert settings_reference.missing_blocks(text) == []
    for key, model in settings_reference.models().items():
        for field in model.model_fields.values():
            if not field.exclude:
                assert f"| `{field.alias}` |" in text, f"{key}.{field.alias}"


def test_the_json_schema_validates_the_example_stacks():
    import jsonschema
    import yaml

    schema = settings_reference.schema()
    assert schema == StackSettings.model_json_schema(by_alias=True)
    for path in sorted((DOC.parent.parent / "stacks").glob("Pulumi.*.yaml")):
        raw = yaml.safe_load(path.read_text())["config"]
        block = {k.split(":", 1)[1]: v for k, v in raw.items() if k.startswith("gpu-train:")}
        jsonschema.validate(json.loads(json.dumps(block)), schema)
    bad = {"cloud": "aws", "environment": "dev", "region": "r", "zones": ["a"], "gpuPoolz": []}
    assert not jsonschema.Draft202012Validator(schema).is_valid(bad)
