"""Which `.Values` paths a Helm chart's templates read, and how: a static scan of Go templates.

Usage:
    scan = scan_templates({"templates/deployment.yaml": text, "templates/_helpers.tpl": text2})
    scan.reads      # {("worker", "nodeSelector"), ("proxy", "ports", "web"), ...}
    scan.whole      # paths rendered whole (toYaml, merge, ...): any sub-keys pass through
    scan.iterated   # paths a `range` walks: the value must be a list or a map
    scan.gaps       # what the scan could not resolve (file, path, why)

A path is a tuple of keys under `.Values`; ELEMENT ("[]") stands for "an item of this list or a
value of this map" (what `range` binds). The scan follows the template language the way
text/template evaluates it, abstractly: `with` and `range` rebind the dot, variables keep what
they were assigned, `include`/`template` run the named template with the argument's binding (so
helpers that receive `.`, `$` or a values sub-tree are followed), and `dict` arguments keep their
keys. What it cannot follow is reported in `gaps`, never guessed: keys computed at render time
(`index .Values $key`), values reached through `tpl` of a values string, and helpers called with
something other than a values path, the root or a dict of those.

Why hand-written: no Python library parses Go's text/template; Helm's own parser is Go. Only the
parts of the language that decide which values are read are modelled here
(https://pkg.go.dev/text/template).

Over 400 lines because the lexer, the parser and the abstract evaluation of the template language are one
interpreter; it is developer tooling, run by `make schemas`, never by the program.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

ELEMENT = "[]"
Path = tuple[str, ...]

# --------------------------------------------------------------------------------------------- lexer

_NUMBER = re.compile(r"[+-]?(0[xX][0-9a-fA-F_]+|[0-9][0-9_]*(\.[0-9_]*)?([eE][+-]?[0-9]+)?|\.[0-9]+)")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_FIELDS = re.compile(r"(\.[A-Za-z_][A-Za-z0-9_]*)+")
_VAR = re.compile(r"\$[A-Za-z0-9_]*")


@dataclass(frozen=True)
class Token:
    kind: str  # str, num, ident, field (.a.b or "."), var ($x or $x.a.b), ( ) | , := =
    text: str
    glued: bool = False  # no space before it: `(x).a` is a field of x, `(x) .a` is a new operand


class TemplateSyntaxError(ValueError):
    pass


def actions(text: str) -> list[tuple[int, str]]:
    """The `{{ ... }}` actions of a template, as (line number, inner text), comments dropped.
    Quoted and raw strings inside an action may contain `}}`."""
    out = []
    i = 0
    n = len(text)
    while True:
        start = text.find("{{", i)
        if start < 0:
            return out
        j = start + 2
        if j < n and text[j] == "-" and j + 1 < n and text[j + 1] in " \t\r\n":
            j += 1
        body_start = j
        while j < n:
            c = text[j]
            if c in "\"'":
                j = _skip_quoted(text, j, c)
                continue
            if c == "`":
                end = text.find("`", j + 1)
                if end < 0:
                    raise TemplateSyntaxError(f"line {text.count(chr(10), 0, start) + 1}: unterminated raw string")
                j = end + 1
                continue
            if text.startswith("}}", j):
                break
            if text.startswith("/*", j):
                end = text.find("*/", j + 2)
                if end < 0:
                    raise TemplateSyntaxError(f"line {text.count(chr(10), 0, start) + 1}: unterminated comment")
                j = end + 2
                continue
            j += 1
        if j >= n:
            raise TemplateSyntaxError(f"line {text.count(chr(10), 0, start) + 1}: unclosed action")
        body = text[body_start:j]
        if body.endswith("-") and (len(body) == 1 or body[-2] in " \t\r\n"):
            body = body[:-1]
        body = body.strip()
        if not (body.startswith("/*") and body.endswith("*/")):
            out.append((text.count("\n", 0, start) + 1, body))
        i = j + 2


def _skip_quoted(text: str, j: int, quote: str) -> int:
    k = j + 1
    while k < len(text):
        if text[k] == "\\":
            k += 2
            continue
        if text[k] == quote:
            return k + 1
        k += 1
    raise TemplateSyntaxError("unterminated string")


def tokens(action: str) -> list[Token]:
    out: list[Token] = []
    i = 0
    n = len(action)
    while i < n:
        c = action[i]
        if c.isspace():
            i += 1
        elif c in "\"'":
            j = _skip_quoted(action, i, c)
            raw = action[i + 1:j - 1]
            out.append(Token("str", bytes(raw, "utf-8").decode("unicode_escape") if "\\" in raw else raw))
            i = j
        elif c == "`":
            j = action.find("`", i + 1)
            out.append(Token("str", action[i + 1:j]))
            i = j + 1
        elif action.startswith(":=", i):
            out.append(Token(":=", ":="))
            i += 2
        elif c in "()|,=":
            out.append(Token(c, c))
            i += 1
        elif c == "$":
            m = _VAR.match(action, i)
            assert m is not None
            end = m.end()
            f = _FIELDS.match(action, end)
            if f:
                end = f.end()
            out.append(Token("var", action[i:end]))
            i = end
        elif c == "." and (i + 1 >= n or not action[i + 1].isdigit()):
            glued = i > 0 and action[i - 1] == ")"
            f = _FIELDS.match(action, i)
            if f:
                out.append(Token("field", f.group(0), glued))
                i = f.end()
            else:
                out.append(Token("field", ".", glued))
                i += 1
        elif c.isdigit() or (c in "+-." and i + 1 < n and action[i + 1].isdigit()):
            m = _NUMBER.match(action, i)
            if not m:
                raise TemplateSyntaxError(f"bad number in {action!r}")
            out.append(Token("num", m.group(0)))
            i = m.end()
        elif c.isalpha() or c == "_":
            m = _IDENT.match(action, i)
            assert m is not None
            end = m.end()
            if m.group(0) not in _KEYWORDS:  # `if.Values.x` is the keyword `if` and a field
                f = _FIELDS.match(action, end)
                if f:
                    end = f.end()
            out.append(Token("ident", action[i:end]))
            i = end
        else:
            raise TemplateSyntaxError(f"unexpected {c!r} in {action!r}")
    return out


# ----------------------------------------------------------------------------------- abstract values


@dataclass(frozen=True)
class Root:
    """The chart's top-level context: .Values, .Release, .Chart, .Capabilities, .Files, .Template."""


@dataclass(frozen=True)
class VPath:
    path: Path


@dataclass(frozen=True)
class Dict:
    items: tuple[tuple[str, Any], ...]

    def get(self, key: str) -> Any:
        for k, v in self.items:
            if k == key:
                return v
        return UNKNOWN


@dataclass(frozen=True)
class ListOf:
    items: tuple[Any, ...]


@dataclass(frozen=True)
class Unknown:
    pass


UNKNOWN = Unknown()
ROOT = Root()

# Functions that only read their arguments (they never hand a sub-tree on whole).
_READERS = {
    "default", "required", "quote", "squote", "toString", "int", "int64", "float64", "atoi", "b64enc", "b64dec",
    "trim", "trimAll", "trimPrefix", "trimSuffix", "trunc", "upper", "lower", "title", "untitle", "nospace",
    "indent", "nindent", "replace", "printf", "print", "println", "eq", "ne", "lt", "le", "gt", "ge", "and", "or",
    "not", "empty", "len", "kindIs", "typeIs", "kindOf", "typeOf", "contains", "hasPrefix", "hasSuffix",
    "semverCompare", "semver", "regexMatch", "regexFind", "regexReplaceAll", "sha256sum", "sha1sum", "adler32sum",
    "ternary", "coalesce", "fail", "camelcase", "snakecase", "kebabcase", "add", "add1", "sub", "mul",
    "div", "mod", "max", "min", "ceil", "floor", "round", "until", "untilStep", "seq", "cat", "join", "split",
    "splitList", "splitn", "first", "last", "rest", "initial", "has", "toDecimal", "htmlEscape", "urlquery",
    "js", "html", "lookup", "isAbs", "base", "dir", "clean", "ext", "now", "date", "dateInZone", "toDate",
    "duration", "mustRegexMatch", "wrap", "abbrev", "repeat", "substr", "regexSplit", "sortAlpha", "reverse",
    "genCA", "genSelfSignedCert", "genSignedCert", "randAlphaNum", "randAlpha", "randNumeric", "uuidv4",
    "derivePassword", "htpasswd", "encryptAES", "decryptAES", "b32enc", "fromYaml", "fromJson", "fromYamlArray",
    "fromJsonArray", "toUpper", "toLower", "float", "must", "hasKey", "index", "get", "dig", "pluck", "list",
    "dict", "include", "template", "tpl", "set", "unset", "keys", "values", "uniq", "compact", "slice", "append",
    "prepend", "concat", "without", "mustAppend", "mustPrepend", "mustFirst", "mustLast",
}
# Functions that hand their (values) arguments on whole: every key below them reaches the output.
_WHOLE = {"toYaml", "toJson", "toPrettyJson", "toRawJson", "mustToYaml", "mustToJson", "mustToPrettyJson",
          "mustToRawJson", "merge", "mergeOverwrite", "mustMerge", "mustMergeOverwrite", "deepCopy", "mustDeepCopy",
          "omit", "pick", "toToml", "toStrings", "keys", "values", "uniq", "compact", "concat", "append",
          "prepend", "without", "slice", "sortAlpha"}
_KEYWORDS = {"if", "else", "end", "range", "with", "define", "template", "block", "break", "continue"}


# -------------------------------------------------------------------------------------- parse tree


@dataclass
class Cmd:
    """One command of a pipeline: a function call (name + args) or a single operand."""
    func: str | None
    args: list[Any]  # Token or Pipe


@dataclass
class Pipe:
    decl: list[str]  # variables declared / assigned
    cmds: list[Cmd]


def parse_pipeline(toks: list[Token]) -> Pipe:
    pos = 0

    def parse_pipe(stop: str | None) -> Pipe:
        nonlocal pos
        decl: list[str] = []
        # $a := ...   $a, $b := ...   $a = ...
        k = pos
        names = []
        while k < len(toks) and toks[k].kind == "var" and "." not in toks[k].text[1:]:
            names.append(toks[k].text)
            if k + 1 < len(toks) and toks[k + 1].kind == ",":
                k += 2
                continue
            break
        if names and k + 1 < len(toks) and toks[k + 1].kind in (":=", "="):
            decl = names
            pos = k + 2
        cmds: list[Cmd] = []
        args: list[Any] = []
        while pos < len(toks):
            t = toks[pos]
            if stop and t.kind == stop:
                break
            if t.kind == "|":
                cmds.append(_cmd(args))
                args = []
                pos += 1
                continue
            if t.kind == "(":
                pos += 1
                inner = parse_pipe(")")
                if pos >= len(toks) or toks[pos].kind != ")":
                    raise TemplateSyntaxError("unbalanced parentheses")
                pos += 1
                # `(expr).a.b`
                if pos < len(toks) and toks[pos].kind == "field" and toks[pos].text != "." and toks[pos].glued:
                    args.append(("chain", inner, toks[pos].text))
                    pos += 1
                else:
                    args.append(inner)
                continue
            if t.kind in (",", ":=", "="):
                raise TemplateSyntaxError(f"unexpected {t.text!r}")
            args.append(t)
            pos += 1
        if args:
            cmds.append(_cmd(args))
        return Pipe(decl, cmds)

    pipe = parse_pipe(None)
    if pos != len(toks):
        raise TemplateSyntaxError("trailing tokens")
    return pipe


def _cmd(args: list[Any]) -> Cmd:
    if not args:
        raise TemplateSyntaxError("empty command")
    head = args[0]
    if isinstance(head, Token) and head.kind == "ident" and head.text not in ("true", "false", "nil") \
            and "." not in head.text:
        return Cmd(head.text, args[1:])
    return Cmd(None, args)


# ------------------------------------------------------------------------------------------ scanner


@dataclass
class Scan:
    reads: set[Path] = field(default_factory=set)
    whole: set[Path] = field(default_factory=set)
    iterated: set[Path] = field(default_factory=set)
    gaps: list[dict[str, str]] = field(default_factory=list)
    functions: set[str] = field(default_factory=set)


@dataclass
class _Block:
    kind: str  # if, with, range, define, root
    dot: Any
    vars: dict[str, Any]
    outer_dot: Any = None


def _split_blocks(text: str, file: str) -> tuple[list[tuple[int, str]], dict[str, list[tuple[int, str]]]]:
    """Top-level actions of a file, and the bodies of its `define`s (by name)."""
    top: list[tuple[int, str]] = []
    defines: dict[str, list[tuple[int, str]]] = {}
    stack: list[tuple[str, str | None]] = []  # (kind, define name)
    current: list[tuple[int, str]] | None = None
    for line, act in actions(text):
        first = _IDENT.match(act)
        word = first.group(0) if first else ""
        if word == "define" and not stack:
            toks = tokens(act)
            if len(toks) < 2 or toks[1].kind != "str":
                raise TemplateSyntaxError(f"{file}:{line}: define without a name")
            stack.append(("define", toks[1].text))
            current = defines.setdefault(toks[1].text, [])
            continue
        if word in ("if", "with", "range", "define", "block"):
            stack.append((word, None))
        elif word == "end":
            if not stack:
                raise TemplateSyntaxError(f"{file}:{line}: unmatched end")
            kind, _ = stack.pop()
            if kind == "define" and not stack:
                current = None
                continue
        (current if current is not None else top).append((line, act))
    if stack:
        raise TemplateSyntaxError(f"{file}: unclosed {stack[-1][0]}")
    return top, defines


class _Scanner:
    def __init__(self, files: Mapping[str, str]):
        self.scan = Scan()
        self.files: dict[str, list[tuple[int, str]]] = {}
        self.defines: dict[str, list[tuple[int, str]]] = {}
        self.define_file: dict[str, str] = {}
        for name, text in sorted(files.items()):
            try:
                top, defs = _split_blocks(text, name)
            except TemplateSyntaxError as exc:
                self.scan.gaps.append({"file": name, "path": "", "why": f"not parsed: {exc}"})
                continue
            self.files[name] = top
            for dname, body in defs.items():
                self.defines[dname] = body  # later files win, as in Helm (alphabetical parse order)
                self.define_file[dname] = name
        self.pending: list[tuple[str, Any]] = []
        self.done: set[tuple[str, str]] = set()
        self.file = ""

    # ---- bookkeeping
    def gap(self, path: Path, why: str) -> None:
        self.scan.gaps.append({"file": self.file, "path": ".".join(path), "why": why})

    def read(self, val: Any) -> None:
        if isinstance(val, VPath) and val.path:
            self.scan.reads.add(val.path)
        elif isinstance(val, Dict):
            for _, v in val.items:
                self.read(v)
        elif isinstance(val, ListOf):
            for v in val.items:
                self.read(v)

    def whole(self, val: Any) -> None:
        if isinstance(val, VPath):
            if val.path:
                self.scan.reads.add(val.path)
            self.scan.whole.add(val.path)
        elif isinstance(val, Root):
            self.scan.whole.add(())
        elif isinstance(val, Dict):
            for _, v in val.items:
                self.whole(v)
        elif isinstance(val, ListOf):
            for v in val.items:
                self.whole(v)

    # ---- evaluation
    def chain(self, base: Any, fields: list[str]) -> Any:
        val = base
        for f in fields:
            if isinstance(val, Root):
                val = VPath(()) if f == "Values" else UNKNOWN
            elif isinstance(val, VPath):
                val = VPath((*val.path, f))
            elif isinstance(val, Dict):
                val = val.get(f)
            else:
                return UNKNOWN
        return val

    def operand(self, arg: Any, block: _Block, vars_: dict[str, Any]) -> Any:
        if isinstance(arg, Pipe):
            return self.pipe(arg, block, vars_)
        if isinstance(arg, tuple) and arg[0] == "chain":
            base = self.pipe(arg[1], block, vars_)
            return self.chain(base, arg[2].split(".")[1:])
        t: Token = arg
        if t.kind == "field":
            if t.text == ".":
                return block.dot
            return self.chain(block.dot, t.text.split(".")[1:])
        if t.kind == "var":
            name, *fields = t.text.split(".")
            base = vars_.get(name, UNKNOWN)
            return self.chain(base, fields)
        if t.kind == "str":
            return ("lit", t.text)
        if t.kind == "num":
            return ("num", t.text)
        if t.kind == "ident":
            return UNKNOWN  # true/false/nil, or a niladic function
        return UNKNOWN

    def pipe(self, pipe: Pipe, block: _Block, vars_: dict[str, Any]) -> Any:
        val: Any = None
        for i, cmd in enumerate(pipe.cmds):
            args = [self.operand(a, block, vars_) for a in cmd.args]
            if i > 0:
                args.append(val)
            val = self.call(cmd.func, args) if cmd.func else (args[0] if len(args) == 1 else UNKNOWN)
            if cmd.func is None and len(args) > 1:
                for a in args:
                    self.read(a)
        return val

    def call(self, func: str, args: list[Any]) -> Any:
        self.scan.functions.add(func)
        lits = [a[1] if isinstance(a, tuple) and a and a[0] == "lit" else None for a in args]
        if func in ("include", "template"):
            if args and lits[0] is not None:
                arg = args[1] if len(args) > 1 else UNKNOWN
                self.queue(lits[0], arg)
            return UNKNOWN
        if func == "dict":
            items = []
            for k in range(0, len(args) - 1, 2):
                if lits[k] is None:
                    for a in args:
                        self.whole(a)
                    return UNKNOWN
                items.append((lits[k], args[k + 1]))
            return Dict(tuple(items))
        if func == "list":
            return ListOf(tuple(args))
        if func in ("index", "get"):
            base, keys = (args[0], args[1:]) if args else (UNKNOWN, [])
            klits = [ELEMENT if isinstance(a, tuple) and a and a[0] == "num" else lit
                     for a, lit in zip(args[1:], lits[1:], strict=True)]
            if isinstance(base, VPath | Dict | Root):
                if all(k is not None for k in klits):
                    out = base
                    for k in klits:
                        out = self.chain(out, [k]) if not isinstance(out, VPath) else VPath((*out.path, k))
                    self.read(out)
                    return out
                if isinstance(base, VPath):
                    # A key computed at render time: every key below is possible.
                    self.read(base)
                    self.scan.iterated.add(base.path) if base.path else None
                    self.gap(base.path, "indexed with a key computed at render time")
                    return VPath((*base.path, ELEMENT))
            for a in keys:
                self.read(a)
            return UNKNOWN
        if func == "hasKey" and len(args) == 2 and isinstance(args[0], VPath) and lits[1] is not None:
            self.read(VPath((*args[0].path, lits[1])))
            return UNKNOWN
        # dig "a" "b" default map
        if func == "dig" and len(args) >= 3 and isinstance(args[-1], VPath) and all(x is not None for x in lits[:-2]):
            out = VPath((*args[-1].path, *[x for x in lits[:-2] if x is not None]))
            self.read(out)
            return out
        if func == "pluck" and lits and lits[0] is not None:
            for a in args[1:]:
                if isinstance(a, VPath):
                    self.read(VPath((*a.path, lits[0])))
            return UNKNOWN
        if func in ("default", "required", "coalesce", "deepCopy", "mustDeepCopy"):
            paths = [a for a in args if isinstance(a, VPath | Dict)]
            for a in args:
                self.read(a)
            if func in ("deepCopy", "mustDeepCopy"):
                return paths[0] if paths else UNKNOWN
            if func == "default":
                return args[-1] if args and isinstance(args[-1], VPath | Dict) else (paths[0] if paths else UNKNOWN)
            return paths[-1] if func == "required" and paths else (paths[0] if paths else UNKNOWN)
        if func in ("concat", "mustConcat"):
            # concat takes lists only: a string there fails the render ("Cannot concat type string as
            # list", sprig's list.go). join, by contrast, also takes a single string.
            for a in args:
                if isinstance(a, VPath) and a.path:
                    self.scan.iterated.add(a.path)
            for a in args:
                self.read(a)
            return UNKNOWN
        if func == "tpl":
            for a in args[:1]:
                self.read(a)
            if args and isinstance(args[0], VPath):
                self.gap(args[0].path, "rendered with tpl: values it reads are not seen")
            return UNKNOWN
        if func in _WHOLE:
            for a in args:
                self.whole(a)
            return UNKNOWN
        if func not in _READERS and func not in _KEYWORDS:
            # A function this scan does not model: its arguments are taken as read whole.
            for a in args:
                if isinstance(a, VPath | Root | Dict):
                    self.whole(a)
                    self.gap(a.path if isinstance(a, VPath) else (), f"passed to {func}")
            return UNKNOWN
        for a in args:
            self.read(a)
        return UNKNOWN

    def queue(self, name: str, arg: Any) -> None:
        key = (name, repr(arg))
        if key in self.done:
            return
        self.done.add(key)
        self.pending.append((name, arg))

    # ---- walking a list of actions
    def walk(self, acts: list[tuple[int, str]], dot: Any, file: str) -> None:
        self.file = file
        root_vars = {"$": dot}
        stack = [_Block("root", dot, root_vars)]
        for line, act in acts:
            try:
                toks = tokens(act)
            except TemplateSyntaxError as exc:
                self.scan.gaps.append({"file": file, "path": "", "why": f"line {line}: not parsed: {exc}"})
                continue
            if not toks:
                continue
            block = stack[-1]
            vars_ = {k: v for b in stack for k, v in b.vars.items()}
            head = toks[0].text if toks[0].kind == "ident" else ""
            try:
                if head == "end":
                    if len(stack) > 1:
                        stack.pop()
                    continue
                if head in ("break", "continue"):
                    continue
                if head == "else":
                    rest = toks[1:]
                    outer = block.outer_dot
                    block.vars = {}
                    if rest and rest[0].kind == "ident" and rest[0].text == "with":
                        val = self.pipe(parse_pipeline(rest[1:]), _Block("", outer, {}), vars_)
                        self.read(val)
                        block.dot = val
                    else:
                        if rest and rest[0].kind == "ident" and rest[0].text == "if":
                            self.read(self.pipe(parse_pipeline(rest[1:]), _Block("", outer, {}), vars_))
                        block.dot = outer
                    continue
                if head in ("if", "with", "range"):
                    pipe = parse_pipeline(toks[1:])
                    val = self.pipe(pipe, block, vars_)
                    new = _Block(head, block.dot, {}, outer_dot=block.dot)
                    if head == "if":
                        self.read(val)
                        for v in pipe.decl:
                            new.vars[v] = val
                    elif head == "with":
                        self.read(val)
                        new.dot = val
                        for v in pipe.decl:
                            new.vars[v] = val
                    else:  # range
                        elem: Any = UNKNOWN
                        if isinstance(val, VPath):
                            self.read(val)
                            if val.path:
                                self.scan.iterated.add(val.path)
                            elem = VPath((*val.path, ELEMENT))
                        elif isinstance(val, ListOf):
                            for v in val.items:
                                self.read(v)
                        new.dot = elem
                        if len(pipe.decl) == 1:
                            new.vars[pipe.decl[0]] = elem
                        elif len(pipe.decl) == 2:
                            new.vars[pipe.decl[0]] = UNKNOWN
                            new.vars[pipe.decl[1]] = elem
                    stack.append(new)
                    continue
                if head == "block" and len(toks) >= 2 and toks[1].kind == "str":
                    arg = self.pipe(parse_pipeline(toks[2:]), block, vars_) if len(toks) > 2 else UNKNOWN
                    self.queue(toks[1].text, arg)
                    stack.append(_Block("block", block.dot, {}, outer_dot=block.dot))
                    continue
                if head == "template" and len(toks) >= 2 and toks[1].kind == "str":
                    arg = self.pipe(parse_pipeline(toks[2:]), block, vars_) if len(toks) > 2 else UNKNOWN
                    self.queue(toks[1].text, arg)
                    continue
                pipe = parse_pipeline(toks)
                val = self.pipe(pipe, block, vars_)
                self.read(val)
                if pipe.decl:
                    target = block if toks[len(pipe.decl) * 2 - 1].kind == ":=" else None
                    for name in pipe.decl:
                        if target is not None:
                            target.vars[name] = val
                        else:  # `=` assigns the nearest declaration
                            for b in reversed(stack):
                                if name in b.vars:
                                    b.vars[name] = val
                                    break
            except TemplateSyntaxError as exc:
                self.scan.gaps.append({"file": file, "path": "", "why": f"line {line}: not parsed: {exc}"})

    def run(self, max_calls: int = 20000) -> Scan:
        for name, acts in self.files.items():
            if name.rsplit("/", 1)[-1].startswith("_"):
                continue  # helpers only: their defines run when called
            self.walk(acts, ROOT, name)
        calls = 0
        while self.pending and calls < max_calls:
            name, arg = self.pending.pop()
            calls += 1
            body = self.defines.get(name)
            if body is None:
                continue  # defined by a library chart or by Helm itself
            self.walk(body, arg, f"{self.define_file[name]}#{name}")
        if self.pending:
            self.scan.gaps.append({"file": "", "path": "", "why": f"stopped after {max_calls} helper calls"})
        return self.scan


def scan_templates(files: Mapping[str, str]) -> Scan:
    """Scan a chart's templates (path relative to the chart -> text)."""
    return _Scanner(files).run()
