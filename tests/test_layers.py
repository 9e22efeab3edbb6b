"""The house's floor plan, read from the code's own imports: layers import one way, the core and the team command
carry neither Pulumi nor torch, and the Kubernetes layer never learns which cloud it is on.

Run: .venv/bin/pytest tests/test_layers.py -q

Every `import` and `from ... import` of every module counts: the ones inside functions (imported lazily), the ones
under `if TYPE_CHECKING:` (for annotations only), and a name taken from a package's face (`from trainer import
Tracker`, resolved through trainer/__init__.py's PUBLIC table or the package's own imports) counts as an edge to
the module that defines it too. The rules:
- gpu_train.spec (the vocabulary) imports only itself, the standard library, pydantic and yaml: no module of the
  project outside gpu_train/spec (SPEC_EXCEPTIONS names any exception, with its reason);
  gpu_train.sizing (what a trainer configuration needs from the hardware) adds only itself;
  gpu_train.carbon (the region tables, the estimate, the ranking) adds itself and the sizing (FLOPs);
  gpu_train.storage (the object stores) adds itself and boto3;
  gpu_train.jobs (the renderer) adds itself, the sizing, the carbon tables and the kubernetes client;
  gpu_train.client (the Python client) adds itself, what jobs may import and the clients it reads the cluster and
  the log stores with; gpu_train.serving (serving's programs: the
  route, the promotion loop, the registry client) adds itself and its clients (kubernetes, MLflow, aiohttp,
  urllib3, prometheus_client); gpu_train.sweeps (the sweep controller, also run in the cluster from the trainer
  image) imports the core, the renderer, the client (its cluster trials are the client's jobs), Optuna, the
  libraries of its outputs (numpy, matplotlib, mlflow) and the object stores (gpu_train.storage: file://, s3://,
  gs:// over boto3, which the trainer reads and writes through too), never the team command; gpu_train.cli (the
  command) adds itself, serving and sweeps, builds on the client, and may import Optuna. None imports pulumi,
  torch, infra, policies, trainer or tools: `serve --local`'s model server (trainer.model_server, transformers
  over torch) is only ever started as its own process (`python -m`), never imported.
- infra (the Pulumi program) imports the core, never policies, trainer, tools, the client or the team command;
  infra/settings.py imports nothing of infra/aws, infra/gcp, infra/k8s; infra/k8s imports no cloud layer and no
  catalog, and its code compares nothing with a cloud's name.
- policies import the core and themselves (and pulumi_policy), never infra or trainer.
- trainer imports the core and itself, never infra, policies, tools, the client, the team command, the sweep
  controller or Optuna (no Optuna code runs in a trial); its model server takes serving's metrics and ports.
- No import cycle between modules of the project, whether lazy imports or annotations close it
  (ANNOTATION_CYCLES names the exceptions, with their reasons).
- Inside trainer/ and gpu_train/, a module imports a name from the module that defines it, never through a
  package's face (the face is for the library's users), so that this graph sees the edge.
- A module of over 400 lines says why in its docstring ("Over 400 lines because ...").
- Components take the values they use: no field of an `*Args` dataclass in infra/aws, infra/gcp or infra/k8s holds
  the whole StackSettings (infra/__main__.py and each `build_platform` read the settings and hand out the fields). This rule is
  read from the imported dataclasses' resolved field types, not from the source text.

Over 400 lines because every rule reads the one import graph built here, and each check has beside it the fixture
that shows it failing on a broken shape.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import typing
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import pulumi
import pulumi.output
import pytest

from gpu_train.spec.settings import ClusterSettings, StackSettings

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("gpu_train", "infra", "policies", "trainer", "tools")
STDLIB = frozenset(__import__("sys").stdlib_module_names)


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def modules(root: Path = ROOT, packages: Sequence[str] = PACKAGES) -> dict[str, Path]:
    return {module_name(p, root): p for package in packages for p in sorted((root / package).rglob("*.py"))}


def _absolute(node: ast.ImportFrom, path: Path, name: str) -> str:
    """The module a `from ... import` names, relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    base = node.module or ""
    if node.level:
        base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base]).strip(".")
    return base


def import_froms(path: Path, name: str) -> Iterator[tuple[str, str, int]]:
    """(module, imported name, line) of every `from ... import` in the file: top level, inside functions and
    under `if TYPE_CHECKING:` alike."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = _absolute(node, path, name)
            yield from ((base, a.name, node.lineno) for a in node.names)


def face(path: Path, name: str) -> dict[str, str]:
    """What a package's __init__ hands out that it does not define: name -> the module that does. Read from its
    top-level `from ... import`s and from a lazy `PUBLIC = {name: module}` table (trainer/__init__.py)."""
    out: dict[str, str] = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            out.update({a.asname or a.name: _absolute(node, path, name) for a in node.names})
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) else None)
        if isinstance(target, ast.Name) and target.id == "PUBLIC" and isinstance(node.value, ast.Dict):
            out.update({k.value: v.value for k, v in zip(node.value.keys, node.value.values, strict=True)
                        if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)})
    return out


def imports_of(path: Path, name: str, faces: dict[str, dict[str, str]]) -> Iterator[str]:
    """Every module an import statement of this file names, absolute; a name taken from a package's face also
    names the module that defines it."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
    for base, imported, _ in import_froms(path, name):
        yield base
        # `from gpu_train.spec import naming` imports the module gpu_train.spec.naming.
        yield f"{base}.{imported}"
        if imported in faces.get(base, {}):
            yield faces[base][imported]


def graph(root: Path = ROOT, packages: Sequence[str] = PACKAGES) -> dict[str, set[str]]:
    mods = modules(root, packages)
    faces = {name: face(path, name) for name, path in mods.items() if path.name == "__init__.py"}
    return {name: set(imports_of(path, name, faces)) for name, path in mods.items()}


def top(name: str) -> str:
    return name.split(".")[0]


def in_layer(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


GRAPH = graph()
MODULES = set(GRAPH)

# (layer, what it may import besides the standard library)
ALLOWED = {
    "gpu_train.spec": ("gpu_train.spec", "pydantic", "pydantic_core", "yaml"),
    "gpu_train.sizing": ("gpu_train.spec", "gpu_train.sizing"),
    "gpu_train.carbon": ("gpu_train.spec", "gpu_train.sizing", "gpu_train.carbon"),
    "gpu_train.storage": ("gpu_train.spec", "gpu_train.storage", "boto3", "botocore", "s3transfer"),
    "gpu_train.jobs": ("gpu_train.spec", "gpu_train.sizing", "gpu_train.carbon", "gpu_train.jobs", "kubernetes"),
    "gpu_train.serving": ("gpu_train.spec", "gpu_train.jobs", "gpu_train.serving", "kubernetes", "mlflow", "aiohttp",
                          "urllib3", "prometheus_client"),
    "gpu_train.client": ("gpu_train.spec", "gpu_train.sizing", "gpu_train.carbon", "gpu_train.jobs", "gpu_train.client",
                         "kubernetes", "yaml", "boto3", "botocore", "google", "prometheus_client", "urllib3"),
    "gpu_train.cli": ("gpu_train", "kubernetes", "yaml", "boto3", "botocore", "google", "prometheus_client",
                      "urllib3", "optuna"),
    "gpu_train.sweeps": ("gpu_train.spec", "gpu_train.jobs", "gpu_train.client", "gpu_train.storage",
                         "gpu_train.sweeps", "pydantic", "yaml", "optuna", "numpy", "matplotlib", "mlflow",
                         "kubernetes", "boto3", "botocore"),
}
# The torch module `gpu-train serve --local` starts as a process of its own.
MODEL_SERVER = "trainer.model_server"
FORBIDDEN = {
    "infra": ("policies", "trainer", "tools", "gpu_train.cli", "gpu_train.client"),
    "policies": ("infra", "trainer", "tools", "gpu_train.cli", "gpu_train.client"),
    "trainer": ("infra", "policies", "tools", "pulumi", "gpu_train.cli", "gpu_train.client", "gpu_train.sweeps",
                "optuna"),
    "gpu_train.spec": ("gpu_train.sizing", "gpu_train.carbon", "gpu_train.jobs", "gpu_train.client", "gpu_train.cli",
                       "gpu_train.sweeps", "gpu_train.storage", "gpu_train.serving"),
    "gpu_train.sizing": ("gpu_train.carbon", "gpu_train.jobs", "gpu_train.client", "gpu_train.cli", "gpu_train.sweeps",
                         "gpu_train.storage", "gpu_train.serving"),
    "gpu_train.carbon": ("gpu_train.jobs", "gpu_train.client", "gpu_train.cli", "gpu_train.sweeps", "gpu_train.storage",
                         "gpu_train.serving"),
    "gpu_train.storage": ("gpu_train.jobs", "gpu_train.client", "gpu_train.cli", "gpu_train.sweeps"),
    "gpu_train.jobs": ("gpu_train.client", "gpu_train.cli", "gpu_train.sweeps"),
    "gpu_train.client": ("gpu_train.cli", "gpu_train.sweeps"),
    "gpu_train.sweeps": ("gpu_train.cli",),
}


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_the_core_and_the_command_import_only_what_they_may(layer):
    bad = []
    for mod, targets in GRAPH.items():
        if not in_layer(mod, layer):
            continue
        for t in targets:
            if top(t) in STDLIB or top(t) == "__future__":
                continue
            if not any(in_layer(t, allowed) for allowed in ALLOWED[layer]):
                bad.append(f"{mod} imports {t}")
    assert bad == [], "\n".join(sorted(bad))


# Imports of a gpu_train/spec module that reach a module of the project outside gpu_train/spec: (module, imported
# module) -> the reason it stays. None today: the vocabulary stands on its own.
SPEC_EXCEPTIONS: dict[tuple[str, str], str] = {}
PROJECT = (*PACKAGES, "tests", "bench", "examples")


def test_the_vocabulary_imports_nothing_of_the_project_beyond_itself():
    """gpu_train/spec is what every layer shares, so it may lean on none of them (lazy and annotation-only imports
    included)."""
    beyond = {(m, t) for m, ts in GRAPH.items() if in_layer(m, "gpu_train.spec") for t in ts
              if top(t) in PROJECT and not in_layer(t, "gpu_train.spec")}
    assert sorted(beyond - set(SPEC_EXCEPTIONS)) == []
    assert sorted(set(SPEC_EXCEPTIONS) - beyond) == [], "an exception no longer needed: drop it"


def face_imports(root: Path = ROOT, packages: Sequence[str] = ("trainer", "gpu_train")) -> list[str]:
    """`from PACKAGE import NAME` where NAME is not defined by PACKAGE/__init__.py but handed out by it (imported
    there, or listed in a lazy PUBLIC table), anywhere in these packages' modules."""
    mods = modules(root, packages)
    faces = {name: face(path, name) for name, path in mods.items() if path.name == "__init__.py"}
    return [f"{path.relative_to(root)}:{line} takes {imported} from {base}'s face; import it from "
            f"{faces[base][imported]}"
            for name, path in mods.items() for base, imported, line in import_froms(path, name)
            if imported in faces.get(base, {}) and f"{base}.{imported}" not in mods]


def test_inside_trainer_and_gpu_train_names_come_from_their_defining_modules():
    """A face (trainer/__init__.py's lazy table, gpu_train/client/__init__.py, trainer/checkpoint/__init__.py) is
    for the packages' users; inside, an import through it hides the edge (and cycles) from this graph."""
    found = face_imports()
    assert found == [], "\n".join(found)


def test_the_face_check_sees_a_name_taken_from_a_lazy_face(tmp_path):
    for name, text in FIXTURE.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert face_imports(tmp_path, ("pkg",)) == ["pkg/state.py:4 takes Loop from pkg's face; import it from pkg.loop"]


def test_neither_pulumi_nor_torch_in_the_core_or_the_command():
    bad = [f"{m} imports {t}" for m, ts in GRAPH.items() if in_layer(m, "gpu_train") for t in ts
           if top(t).startswith("pulumi") or top(t) in ("torch", "transformers")]
    assert bad == []


def test_the_model_server_is_started_never_imported():
    """The torch of `serve --local` stays in its own process: no module imports the model server; the local mode
    starts it as `python -m trainer.model_server`."""
    importers = sorted(m for m, ts in GRAPH.items() if MODEL_SERVER in ts)
    assert importers == []
    assert any(top(t) == "torch" for t in GRAPH[MODEL_SERVER])
    assert f'"-m", "{MODEL_SERVER}"' in (ROOT / "gpu_train" / "serving" / "local.py").read_text()


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layers_never_import_upward(layer):
    bad = [f"{m} imports {t}" for m, ts in GRAPH.items() if in_layer(m, layer) for t in ts
           for f in FORBIDDEN[layer] if in_layer(t, f) or (f == "pulumi" and top(t).startswith("pulumi")
                                                             and top(t) != "pulumi_policy")]
    assert bad == [], "\n".join(sorted(bad))


def test_the_settings_loader_imports_no_layer_below_it():
    bad = [t for t in GRAPH["infra.settings"] if any(in_layer(t, p) for p in ("infra.aws", "infra.gcp", "infra.k8s"))]
    assert bad == []


def test_the_kubernetes_layer_imports_no_cloud_and_no_catalog():
    bad = [f"{m} imports {t}" for m, ts in GRAPH.items() if in_layer(m, "infra.k8s") for t in ts
           if in_layer(t, "infra.aws") or in_layer(t, "infra.gcp") or in_layer(t, "gpu_train.spec.catalog")
           or top(t) in ("pulumi_aws", "pulumi_gcp")]
    assert bad == [], "\n".join(sorted(bad))


CLOUD_WORDS = ("aws", "gcp", "eks", "gke", "efa", "tcpx", "tcpxo", "rdma", "karpenter", "node-pool", "node-group")


def test_the_kubernetes_layer_compares_nothing_with_a_cloud():
    """No `x == "aws"`, `kind in ("efa", ...)` or `provisioner == "node-pool"` in infra/k8s: what differs between
    clouds comes in the platform contract's fields (node add-ons, pod environment, log store)."""
    bad = []
    for name, path in modules().items():
        if not in_layer(name, "infra.k8s"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                for side in [node.left, *node.comparators]:
                    values = [side] + (list(side.elts) if isinstance(side, ast.Tuple | ast.List | ast.Set) else [])
                    for v in values:
                        if isinstance(v, ast.Constant) and isinstance(v.value, str) and v.value.lower() in CLOUD_WORDS:
                            bad.append(f"{name}:{node.lineno} compares with {v.value!r}")
    assert bad == [], "\n".join(bad)


def annotation_imports(path: Path) -> set[str]:
    """The modules a file imports under `if TYPE_CHECKING:` (for annotations only, never run)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for inner in node.body:
                for sub in ast.walk(inner):
                    if isinstance(sub, ast.ImportFrom) and sub.module:
                        found |= {sub.module, *(f"{sub.module}.{a.name}" for a in sub.names)}
                    elif isinstance(sub, ast.Import):
                        found |= {a.name for a in sub.names}
    return found


# Import edges left out of the cycle check, each an annotation-only import (under `if TYPE_CHECKING:`) with the
# reason it stays. Nothing in trainer/ or gpu_train/ is here.
ANNOTATION_CYCLES: dict[tuple[str, str], str] = {
    ("tools.cluster.controllers", "tools.cluster.plane"):
        "developer tooling, not shipped: the control plane (plane.py) starts the controllers, whose installers "
        "take that Plane back as their argument; the import types the argument and never runs",
}


def cycles(graph: dict[str, set[str]], leave_out: Iterable[tuple[str, str]] = ()) -> list[list[str]]:
    """Every import cycle between the graph's modules, as found by a depth-first walk (each closed once)."""
    left_out = set(leave_out)
    edges = {m: {t for t in ts if t in graph and t != m and (m, t) not in left_out} for m, ts in graph.items()}
    # A package's __init__ importing its own submodules is how Python packages are built, not a cycle in the
    # design: leave those edges out.
    edges = {m: {t for t in ts if not t.startswith(m + ".")} for m, ts in edges.items()}
    seen: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        seen[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if seen.get(nxt) == 1:
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in seen:
                visit(nxt)
        stack.pop()
        seen[node] = 2

    for node in sorted(edges):
        if node not in seen:
            visit(node)
    return found


def test_no_import_cycle_between_modules():
    """Lazy imports inside functions, annotation-only imports and names taken from a package's face all count."""
    found = cycles(GRAPH, leave_out=ANNOTATION_CYCLES)
    assert found == [], "\n".join(" -> ".join(c) for c in found)


@pytest.mark.parametrize("edge", sorted(ANNOTATION_CYCLES))
def test_each_cycle_left_out_is_real_and_for_annotations_only(edge):
    importer, imported = edge
    assert imported in annotation_imports(modules()[importer]), \
        f"{importer} no longer imports {imported} for annotations only: drop the exception"
    assert cycles(GRAPH) != cycles(GRAPH, leave_out=[edge]), f"{edge} closes no cycle any more: drop the exception"


FIXTURE = {  # the two shapes of cycle this check missed before it read lazy faces and annotations
    "pkg/__init__.py": 'PUBLIC = {"Loop": "pkg.loop"}\n\ndef __getattr__(name):\n    import importlib\n\n'
                       '    return getattr(importlib.import_module(PUBLIC[name]), name)\n',
    "pkg/loop.py": "from pkg.state import restore\n\nclass Loop:\n    pass\n",
    "pkg/state.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg import Loop\n\n"
                    "def restore(loop: 'Loop') -> None:\n    pass\n",
    "vocab/__init__.py": "",
    "vocab/settings.py": "def parse(raw):\n    from vocab.checks import problems\n\n    return problems(raw)\n",
    "vocab/checks.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from vocab.settings import Model\n\n"
                       "def problems(raw):\n    return []\n",
}


def test_the_cycle_check_sees_cycles_through_lazy_faces_functions_and_annotations(tmp_path):
    """The check above would pass on a graph blind to these edges: prove it finds both shapes."""
    for name, text in FIXTURE.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = cycles(graph(tmp_path, ("pkg", "vocab")))
    assert sorted(found) == [["pkg.loop", "pkg.state", "pkg.loop"], ["vocab.checks", "vocab.settings", "vocab.checks"]]


def test_the_graph_is_read_from_the_code():
    """The checks above would pass on an empty graph: prove the reader sees the project's imports."""
    assert "gpu_train.spec.naming" in GRAPH["infra.k8s.tenancy"]
    assert "gpu_train.jobs.jobset" in GRAPH["infra.k8s.training"]
    assert any(top(t) == "torch" for t in GRAPH["trainer.model"])
    assert any(top(t) == "pulumi" for t in GRAPH["infra.k8s.gpu"])
    assert "gpu_train.client.status" in GRAPH["gpu_train.client.jobs"]
    assert "gpu_train.client.status" in GRAPH["gpu_train.cli.show"]
    assert "gpu_train.spec.settings" in GRAPH["gpu_train.spec.settings_checks"]
    assert "tools.cluster.plane" in GRAPH["tools.cluster.controllers"]  # under `if TYPE_CHECKING:`


def test_a_module_over_400_lines_says_why():
    """A long module is a choice its docstring explains, never an accident of growth."""
    unexplained = []
    for package in (*PACKAGES, "bench", "examples"):
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text()
            if text.count("\n") > 400 and "Over 400 lines because" not in (ast.get_docstring(ast.parse(text)) or ""):
                unexplained.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
    assert not unexplained, "modules over 400 lines whose docstring gives no reason: " + ", ".join(unexplained)


def holds(hint: object, target: type) -> bool:
    """Whether a resolved type hint is `target` or has it inside (`X | None`, `Sequence[X]`, `dict[str, X]`)."""
    return hint is target or any(holds(arg, target) for arg in typing.get_args(hint))


def args_classes(layer: str) -> list[type]:
    """The `*Args` dataclasses defined in the modules of a layer."""
    found = []
    for name in sorted(m for m in MODULES if in_layer(m, layer)):
        for obj in vars(importlib.import_module(name)).values():
            if (isinstance(obj, type) and dataclasses.is_dataclass(obj) and obj.__module__ == name
                    and obj.__name__.endswith("Args")):
                found.append(obj)
    return found


def settings_fields(cls: type) -> list[str]:
    """The fields of a dataclass whose resolved type holds StackSettings."""
    # pulumi.Input[T] is Union[T, Awaitable[T], "Output[T]"]: that forward reference resolves in pulumi.output.
    hints = typing.get_type_hints(cls, localns={"Output": pulumi.output.Output, "T": pulumi.output.T})
    return [f"{cls.__module__}.{cls.__name__}.{f.name}" for f in dataclasses.fields(cls)
            if holds(hints[f.name], StackSettings)]


# A few components of each layer, so the check cannot pass by finding nothing.
KNOWN_ARGS = {
    "infra.k8s": {"PlatformContractArgs", "TenancyArgs", "MonitoringArgs", "MlflowServerArgs", "HealthArgs"},
    "infra.aws": {"NetworkArgs", "StorageArgs", "ClusterArgs", "KeysArgs", "DatabaseArgs"},
    "infra.gcp": {"GkeClusterArgs", "DatabaseArgs", "GpuNodePoolArgs", "IdentitiesArgs", "KeysArgs", "NetworkArgs",
                  "ArtifactRegistryArgs", "ProjectServicesArgs", "StorageArgs"},
}


@pytest.mark.parametrize("layer", sorted(KNOWN_ARGS))
def test_components_take_fields_not_the_stack_settings(layer):
    classes = args_classes(layer)
    assert KNOWN_ARGS[layer] <= {c.__name__ for c in classes}
    bad = [f for cls in classes for f in settings_fields(cls)]
    assert bad == [], "take the fields the component uses instead:\n" + "\n".join(bad)


@dataclasses.dataclass(frozen=True, kw_only=True)
class WholeSettingsArgs:
    """What the check refuses: the whole settings, bare or inside other types (and a sub-model, which it allows)."""

    cfg: StackSettings
    maybe: StackSettings | None = None
    many: Sequence[StackSettings] = ()
    cluster: ClusterSettings = dataclasses.field(default_factory=ClusterSettings)
    key: pulumi.Input[str] = ""


def test_the_settings_field_check_sees_the_settings_inside_other_types():
    """The check above would pass if it never recognised a StackSettings field: prove it does."""
    assert [f.rsplit(".", 1)[1] for f in settings_fields(WholeSettingsArgs)] == ["cfg", "maybe", "many"]
