"""The one YAML reader of the files users write: stack settings, job specs, service specs, sweep specs and trainer
config files.

Usage:
    from gpu_train.spec.yamlfile import DuplicateKeyError, load
    raw = load(path.read_text())     # like yaml.safe_load; a key given twice in one mapping raises DuplicateKeyError

PyYAML's safe loader keeps the last of two equal keys in a mapping and says nothing, so a setting written twice
(`maxNodes: 4` here, `maxNodes: 40` twenty lines below) silently takes the second value. YAML itself requires the
keys of a mapping to be unique (YAML 1.2, section 3.2.1.1); this reader refuses a repeated key, naming it and both
of its lines. Keys that a merge (`<<: *defaults`) brings in may be overridden, as YAML intends.
"""

from __future__ import annotations

from typing import Any

import yaml

__all__ = ["DuplicateKeyError", "load"]

_MERGE = "tag:yaml.org,2002:merge"


class DuplicateKeyError(yaml.YAMLError):
    """A mapping gives one key twice; the message names the key and both lines, on one line."""


class _Loader(yaml.SafeLoader):
    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE:
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = lines.get(key)
            except TypeError:  # an unhashable key: the constructor below refuses it with its own message
                continue
            if first is not None:
                where = f"lines {first} and {line}" if first != line else f"line {line}"
                raise DuplicateKeyError(f"key {key!r} is given twice in one mapping, on {where} (keep one)")
            lines[key] = line
        return super().construct_mapping(node, deep=deep)


def load(text: str) -> Any:
    """The document in `text`, read like yaml.safe_load, with every mapping's keys unique."""
    return yaml.load(text, Loader=_Loader)  # noqa: S506 - a safe loader
