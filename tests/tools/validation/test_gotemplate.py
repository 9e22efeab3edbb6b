"""The Go-template scan: which `.Values` paths templates read, render whole or range over.

Usage: .venv/bin/pytest tests/tools/validation/test_gotemplate.py -q

Expected paths are read off the template text by hand (text/template semantics), not from the scanner.
"""

from __future__ import annotations

import pytest

from tools.validation.gotemplate import ELEMENT, TemplateSyntaxError, actions, scan_templates, tokens


def scan(text: str, **helpers: str):
    files = {"templates/t.yaml": text}
    files.update({f"templates/_{name}.tpl": body for name, body in helpers.items()})
    return scan_templates(files)


def test_plain_paths_and_index_with_dashed_keys():
    s = scan('{{ .Values.a.b }} {{ $.Values.c }} {{ index .Values "d-e" "f" }} {{ index .Values.list 0 }}')
    assert {("a", "b"), ("c",), ("d-e", "f"), ("list", ELEMENT)} <= s.reads


def test_with_rebinds_the_dot_and_else_restores_it():
    s = scan("{{ with .Values.metrics }}{{ .port }}{{ else }}{{ .Values.fallback }}{{ end }}")
    assert ("metrics", "port") in s.reads and ("fallback",) in s.reads


def test_range_marks_the_collection_and_binds_elements():
    s = scan("{{ range .Values.volumes }}{{ .name }}{{ end }}"
             "{{ range $k, $v := .Values.env }}{{ $k }}={{ $v.value }}{{ end }}")
    assert {("volumes",), ("env",)} <= s.iterated
    assert ("volumes", ELEMENT, "name") in s.reads and ("env", ELEMENT, "value") in s.reads


def test_variables_keep_what_they_were_assigned_and_dollar_is_the_root():
    s = scan("{{ $p := .Values.probe }}{{ with .Values.x }}{{ $p.period }}{{ $.Values.y }}{{ end }}")
    assert {("probe", "period"), ("y",), ("x",)} <= s.reads


def test_to_yaml_renders_a_subtree_whole_and_concat_needs_a_list():
    s = scan("{{ toYaml .Values.resources }}{{ .Values.nodeSelector | toYaml }}"
             '{{ concat (list "-a") .Values.jvmOptions }}')
    assert {("resources",), ("nodeSelector",)} <= s.whole
    assert ("jvmOptions",) in s.iterated and ("jvmOptions",) not in s.whole


def test_join_takes_a_string_too_so_it_does_not_require_a_list():
    # sprig's join turns a non-list into a one-element list.
    s = scan('{{ .Values.namespaces | join "," }}')
    assert ("namespaces",) in s.reads and ("namespaces",) not in s.iterated


def test_helpers_run_with_the_argument_they_receive():
    s = scan('{{ include "h.root" . }}{{ include "h.sub" .Values.db }}{{ include "h.dict" (dict "ctx" $ "p" .Values.port) }}',
             helpers='{{- define "h.root" -}}{{ .Values.fromRoot }}{{- end -}}'
                     '{{- define "h.sub" -}}{{ .host }}{{- end -}}'
                     '{{- define "h.dict" -}}{{ .p.number }}{{ .ctx.Values.fromCtx }}{{- end -}}')
    assert {("fromRoot",), ("db", "host"), ("port", "number"), ("fromCtx",)} <= s.reads


def test_a_parenthesised_result_takes_a_field_only_when_glued():
    s = scan("{{ (.Values.a).b }}{{ default (list) .Values.c }}")
    assert ("a", "b") in s.reads and ("c",) in s.reads


def test_what_the_scan_cannot_see_is_reported_as_a_gap():
    s = scan("{{ index .Values.map $key }}{{ tpl .Values.template . }}")
    whys = " ".join(g["why"] for g in s.gaps)
    assert "computed at render time" in whys and "tpl" in whys
    assert ("map",) in s.iterated  # every key of the map can be read


def test_comments_raw_strings_and_quoted_braces_are_not_actions():
    text = '{{/* {{ .Values.commented }} */}}a{{ "}}" }}{{ `{{ .Values.raw }}` }}{{- .Values.real -}}'
    assert [a for _, a in actions(text)] == ['"}}"', "`{{ .Values.raw }}`", ".Values.real"]
    s = scan(text)
    assert s.reads == {("real",)}


def test_a_broken_template_is_an_error_not_a_silent_pass():
    with pytest.raises(TemplateSyntaxError):
        actions("{{ .Values.a ")
    with pytest.raises(TemplateSyntaxError):
        tokens('"unterminated')
    s = scan_templates({"templates/bad.yaml": "{{ if .Values.a }}never closed"})
    assert s.gaps and "not parsed" in s.gaps[0]["why"]


def test_a_keyword_glued_to_a_field_is_still_the_keyword():
    # Go's lexer reads `if.Values.x` as `if .Values.x` (aws-load-balancer-controller writes it so).
    s = scan("{{- if.Values.serviceMonitor.enabled }}x{{- end }}{{ with.Values.extra }}{{ .y }}{{ end }}")
    assert ("serviceMonitor", "enabled") in s.reads and ("extra", "y") in s.reads and s.gaps == []
