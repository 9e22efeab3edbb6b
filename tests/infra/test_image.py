"""Tests for the trainer image: the Dockerfile (checkov + structure), .dockerignore, the content-hash tag,
and the TrainerImage component under Pulumi mocks.

Run: .venv/bin/pytest tests/infra/test_image.py -q
"""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
from pathlib import Path

import pulumi
import pytest
import yaml
from pulumi.runtime.mocks import MockMonitor

from gpu_train.spec import naming
from infra import image
from infra.mocks import MockContext, PlanMocks
from infra.platform import Registry

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "trainer" / "Dockerfile"
CHECKOV = ROOT / ".venv-checkov" / "bin" / "checkov"
REPO = "123456789012.dkr.ecr.us-east-1.amazonaws.com/gpu-train-aws-dev-trainer"


def _stages(text: str) -> dict[str, str]:
    """Dockerfile text of each stage, keyed by its alias."""
    parts = re.split(r"^FROM\s+", text, flags=re.M)[1:]
    out = {}
    for part in parts:
        header = part.splitlines()[0]
        alias = header.split(" AS ")[-1].strip() if " AS " in header else header
        out[alias] = "FROM " + part
    return out


# ------------------------------------------------------------------------------------------- Dockerfile


@pytest.mark.integration  # runs checkov
def test_checkov_passes_on_dockerfile_with_only_the_documented_skip():
    proc = subprocess.run(
        [str(CHECKOV), "-f", str(DOCKERFILE), "--framework", "dockerfile", "--skip-download", "--output", "json"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["summary"]["failed"] == 0
    assert report["summary"]["passed"] > 50
    skipped = {c["check_id"] for c in report["results"]["skipped_checks"]}
    assert skipped == {"CKV_DOCKER_2"}  # HEALTHCHECK: batch job, reason written next to the skip


def test_dockerfile_is_multi_stage_pinned_and_runs_as_the_jobs_uid():
    text = DOCKERFILE.read_text()
    stages = _stages(text)
    assert list(stages) == ["builder", "runtime"]
    for line in re.findall(r"^FROM\s+(\S+)", text, flags=re.M):
        name, _, tag = line.partition(":")
        assert tag and tag != "latest" and re.search(r"\d", tag), f"base image {line} is not pinned"
    runtime = stages["runtime"]
    # No build tools or caches in the final stage: no compiler packages, no pip, no uv, no download tools.
    for tool in ("build-essential", "gcc", "g++", "pip install", "uv pip", "curl ", "wget "):
        assert tool not in runtime, f"final stage mentions {tool!r}"
    assert "COPY --from=builder /opt/venv /opt/venv" in runtime
    users = re.findall(r"^USER\s+(\S+)", runtime, flags=re.M)
    assert users and users[-1] == f"{naming.TRAINER_UID}:{naming.TRAINER_UID}"
    assert f"--uid {naming.TRAINER_UID}" in runtime
    assert "--skip-kmod --skip-limit-conf --no-verify" in runtime  # EFA installer, container mode
    labels = set(re.findall(r"(org\.opencontainers\.image\.[a-z.]+)=", runtime))
    assert {"org.opencontainers.image.title", "org.opencontainers.image.revision",
            "org.opencontainers.image.version", "org.opencontainers.image.licenses"} <= labels
    assert 'CMD ["python", "-m", "trainer", "--help"]' in runtime
    # A team's image adds its code to /workspace, where every job's command runs (docs/your-code.md).
    assert re.findall(r"^WORKDIR\s+(\S+)", runtime, flags=re.M)[-1] == "/workspace"
    assert "install -d -o 10001 -g 10001 /workspace" in runtime
    # torch pinned to the project's version and installed from the CUDA index in the builder.
    pyproject = (ROOT / "pyproject.toml").read_text()
    torch_pin = re.search(r'"torch==([0-9.]+)"', pyproject).group(1)
    assert f"ARG TORCH_VERSION={torch_pin}" in stages["builder"]
    assert "--index-url \"${TORCH_INDEX_URL}\"" in stages["builder"]


def test_dockerignore_keeps_what_the_dockerfile_copies_and_drops_the_rest():
    patterns = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
    # The team command and the developer tools stay out of the image with the rest.
    for required in (".git", ".venv*", "runs/", "build/", "tests/", "bench/", "**/__pycache__", "infra/",
                     "gpu_train/cli/", "examples/", "tools/"):
        assert required in patterns, required
    copied = re.findall(r"^COPY (?!--from)(.+) \S+$", DOCKERFILE.read_text(), flags=re.M)
    sources = [s for line in copied for s in line.split() if not s.startswith("--")]
    # The trainer, the core it imports (the platform's vocabulary and the launcher), and the programs the platform
    # runs from this image: serving's (a service's route, the promotion loop) and the sweep controller, on the client.
    assert set(sources) == {"pyproject.toml", "trainer", "trainer/entrypoint.sh", "gpu_train/__init__.py",
                            "gpu_train/storage.py", "gpu_train/spec", "gpu_train/jobs", "gpu_train/serving",
                            "gpu_train/client", "gpu_train/sweeps"}
    inputs = image.image_inputs()
    for src in sources:
        assert src not in patterns and f"{src}/" not in patterns
        # The tag hashes every copied input.
        assert src in inputs or any(i.startswith(f"{src}/") for i in inputs)


def test_the_tag_covers_exactly_what_the_image_is_made_of():
    inputs = image.image_inputs()
    # pyproject.toml, the trainer package and the core it imports; nothing of the README, infra, the team command,
    # tests, docs, stacks or the workflow files (the build writes its own one-line README for the package metadata).
    assert {"pyproject.toml", "trainer/entrypoint.sh", "trainer/__main__.py", "gpu_train/__init__.py",
            "gpu_train/storage.py", "gpu_train/jobs/launch.py", "gpu_train/spec/trainer_config.py"} <= set(inputs)
    assert {i.split("/")[0] for i in inputs} == {"pyproject.toml", "trainer", "gpu_train"}
    assert {i.split("/")[1] for i in inputs if i.startswith("gpu_train/") and i.count("/") > 1} == {
        "spec", "jobs", "serving", "client", "sweeps"}
    assert not any("__pycache__" in i or i.endswith(".pyc") for i in inputs)


def test_ci_workflow_builds_this_dockerfile_without_pushing_prs_and_runs_the_trainer():
    wf = yaml.safe_load((ROOT / ".github" / "workflows" / "image.yml").read_text())
    steps = wf["jobs"]["build"]["steps"]
    for step in steps:
        if "uses" in step:
            assert re.search(r"@(v\d+\.\d+\.\d+|[0-9a-f]{40})$", step["uses"]), f"unpinned action {step['uses']}"
    (build,) = [s for s in steps if s.get("uses", "").startswith("docker/build-push-action@")]
    assert build["with"]["file"] == "trainer/Dockerfile" and build["with"]["context"] == "."
    assert build["with"]["push"] is False and build["with"]["load"] is True
    assert any(s.get("uses", "").startswith("docker/setup-buildx-action@") for s in steps)
    smoke = next(s["run"] for s in steps if s.get("name") == "Smoke test")
    assert 'docker run --rm "$LOCAL_TAG" python -m trainer --help' in smoke
    assert f'= "{naming.TRAINER_UID}"' in smoke
    (push,) = [s for s in steps if s.get("name") == "Push"]
    assert push["if"] == "github.event_name != 'pull_request'"


# ------------------------------------------------------------------------------------------- tag and ref


DOCKERFILE_TEXT = """\
# syntax=docker/dockerfile:1.7
FROM python:3.11-slim AS builder
COPY --from=ghcr.io/astral-sh/uv:0.9.5 /uv /usr/local/bin/uv
COPY pyproject.toml README.md ./
RUN pip install \\
    --no-deps .
COPY trainer ./trainer
FROM python:3.11-slim
COPY --from=builder /src /src
COPY --chmod=0755 trainer/entrypoint.sh /usr/local/bin/launch
"""


def _tree(root: Path) -> Path:
    (root / "trainer" / "data").mkdir(parents=True)
    (root / "trainer" / "__init__.py").write_text("")
    (root / "trainer" / "data" / "store.py").write_text("X = 1\n")
    (root / "trainer" / "entrypoint.sh").write_text("#!/bin/sh\nexec torchrun \"$@\"\n")
    (root / "trainer" / "Dockerfile").write_text(DOCKERFILE_TEXT)
    (root / "pyproject.toml").write_text("[project]\nname='x'\nreadme='README.md'\n")
    (root / "README.md").write_text("x\n")
    (root / "Makefile").write_text("all:\n")
    (root / ".dockerignore").write_text("# context\n.git\n**/__pycache__\n**/*.py[cod]\ntests/\ndocs/\n")
    return root


def test_image_inputs_are_the_copied_context_files(tmp_path):
    root = _tree(tmp_path)
    assert image.image_inputs(root) == ["README.md", "pyproject.toml", "trainer/Dockerfile", "trainer/__init__.py",
                                        "trainer/data/store.py", "trainer/entrypoint.sh"]


def test_context_hash_follows_content_and_ignores_caches(tmp_path):
    root = _tree(tmp_path)
    first = image.context_hash(root)
    assert re.fullmatch(r"[0-9a-f]{64}", first)
    (root / "trainer" / "__pycache__").mkdir()
    (root / "trainer" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    (root / "trainer" / "data" / "store.cpython-311.pyc").write_bytes(b"\1")
    (root / "tests").mkdir()
    (root / "tests" / "t.py").write_text("unrelated\n")
    assert image.context_hash(root) == first
    (root / "trainer" / "data" / "store.py").write_text("X = 2\n")
    changed = image.context_hash(root)
    assert changed != first
    # A rename with the same bytes is a different context too.
    (root / "trainer" / "data" / "store.py").rename(root / "trainer" / "data" / "other.py")
    assert image.context_hash(root) not in (first, changed)


def test_files_the_image_does_not_contain_leave_the_tag_alone(tmp_path):
    root = _tree(tmp_path)
    first = image.context_hash(root)
    (root / "docs").mkdir()
    (root / "docs" / "guide.md").write_text("new page\n")  # excluded by .dockerignore
    (root / "Makefile").write_text("all:\n\ttrue\n")  # in the context, but no COPY takes it
    (root / ".dockerignore").write_text((root / ".dockerignore").read_text() + "# a comment\n")
    assert image.context_hash(root) == first


def test_what_the_image_does_contain_changes_the_tag(tmp_path):
    root = _tree(tmp_path)
    tags = {image.context_hash(root)}
    # README.md is copied (pyproject declares it; its text becomes the package metadata in the image).
    (root / "README.md").write_text("y\n")
    tags.add(image.context_hash(root))
    # COPY keeps the executable bit.
    (root / "trainer" / "data" / "store.py").chmod(0o755)
    tags.add(image.context_hash(root))
    # The Dockerfile itself.
    (root / "trainer" / "Dockerfile").write_text(DOCKERFILE_TEXT + "ENV X=1\n")
    tags.add(image.context_hash(root))
    assert len(tags) == 4


def test_context_hash_names_a_missing_input(tmp_path):
    root = _tree(tmp_path)
    (root / "README.md").unlink()
    with pytest.raises(FileNotFoundError, match="README.md.*trainer/Dockerfile:4"):
        image.context_hash(root)


def test_a_copy_source_excluded_by_dockerignore_is_named(tmp_path):
    root = _tree(tmp_path)
    (root / ".dockerignore").write_text("README.md\n")
    with pytest.raises(FileNotFoundError, match="README.md.*excluded by .dockerignore"):
        image.image_inputs(root)


@pytest.mark.parametrize("line", ["ADD https://example.com/x.tar.gz /x", "COPY ${SRC} /x", 'COPY ["a", "/b"]'])
def test_sources_the_tag_cannot_follow_are_refused(tmp_path, line):
    root = _tree(tmp_path)
    (root / "trainer" / "Dockerfile").write_text(DOCKERFILE_TEXT + line + "\n")
    with pytest.raises(ValueError, match="^trainer/Dockerfile:11: "):
        image.image_inputs(root)


def test_a_run_bind_mount_of_the_context_is_an_input(tmp_path):
    root = _tree(tmp_path)
    (root / "tools").mkdir()
    (root / "tools" / "gen.py").write_text("print(1)\n")
    (root / "trainer" / "Dockerfile").write_text(
        DOCKERFILE_TEXT + "RUN --mount=type=bind,source=tools,target=/t python /t/gen.py\n")
    assert "tools/gen.py" in image.image_inputs(root)


def test_pinned_ref_requires_a_sha256_digest():
    digest = "sha256:" + "a" * 64
    assert image.pinned_ref(REPO, digest) == f"{REPO}@{digest}"
    for bad in ("", "latest", "sha256:abc", "md5:" + "a" * 64):
        with pytest.raises(ValueError, match="gpu-train-aws-dev-trainer"):
            image.pinned_ref(REPO, bad)


# ------------------------------------------------------------------------------------------- component


CACHE_REPO = REPO + "-buildcache"


def _run(prebuilt: str = "", cache: str | None = CACHE_REPO) -> tuple[MockMonitor, str, str]:
    """Build the component under fresh mocks; returns (monitor, ref, tag) once every output resolved."""
    asyncio.set_event_loop(asyncio.new_event_loop())
    mocks = PlanMocks(MockContext(region="us-east-1"))
    monitor = MockMonitor(mocks)
    pulumi.runtime.set_mocks(mocks, project="gpu-train", stack="aws-dev", preview=False, monitor=monitor)
    seen: dict[str, str] = {}

    @pulumi.runtime.test
    def build():
        comp = image.TrainerImage("trainer", image.TrainerImageArgs(registry=_registry(cache), prebuilt=prebuilt))
        return pulumi.Output.all(comp.ref, comp.tag).apply(lambda v: seen.update(ref=v[0], tag=v[1]))

    build()
    return monitor, seen["ref"], seen["tag"]


def _registry(cache: str | None) -> Registry:
    return Registry(
        repository=pulumi.Output.from_input(REPO),
        cache_repository=None if cache is None else pulumi.Output.from_input(cache),
        server=pulumi.Output.from_input("123456789012.dkr.ecr.us-east-1.amazonaws.com"),
        username=pulumi.Output.from_input("AWS"),
        password=pulumi.Output.secret("token"),
    )


def _image_inputs(monitor) -> list[dict]:
    regs = monitor.get_registered_resources()
    return [state for urn, (_, _, state) in regs.items() if "docker-build:index:Image" in urn]


def test_component_builds_pushes_and_exports_a_digest_pinned_ref():
    monitor, ref, tag = _run()
    assert tag == image.image_tag()
    assert re.fullmatch(re.escape(REPO) + r"@sha256:[0-9a-f]{64}", ref)
    (inputs,) = _image_inputs(monitor)
    assert inputs["push"] is True
    assert inputs["platforms"] == ["linux/amd64"]
    assert inputs["tags"] == [f"{REPO}:{tag}"]
    assert inputs["context"]["location"] == str(ROOT)
    assert inputs["dockerfile"]["location"] == str(ROOT / "trainer" / "Dockerfile")
    # The cache tag is rewritten by every build: it goes to the cache repository, never to the image
    # repository, whose tags are immutable.
    assert inputs["cacheFrom"] == [{"registry": {"ref": f"{CACHE_REPO}:buildcache"}}]
    (cache_to,) = inputs["cacheTo"]
    assert cache_to["registry"]["ref"] == f"{CACHE_REPO}:buildcache"
    assert cache_to["registry"]["mode"] == "max"
    assert cache_to["registry"]["imageManifest"] is True
    # The registry password is a secret, so the engine keeps the whole list secret.
    registries = inputs["registries"]
    assert registries.get("4dabf18193072939515e22adb298388d") == "1b47061264138c4ac30d75fd1eb44270"
    (reg,) = registries["value"]
    assert reg["address"] == "123456789012.dkr.ecr.us-east-1.amazonaws.com"
    assert reg["username"] == "AWS"
    assert inputs["buildArgs"] == {"REVISION": tag}
    # The digest in the exported ref is the one the (mocked) build reported.
    state = next(s for urn, (_, _, s) in monitor.get_registered_resources().items()
                 if "docker-build:index:Image" in urn)
    assert ref.endswith("@" + state["digest"])


def test_no_cache_repository_means_no_registry_cache():
    monitor, ref, tag = _run(cache=None)
    (inputs,) = _image_inputs(monitor)
    assert not inputs.get("cacheFrom") and not inputs.get("cacheTo")
    assert inputs["tags"] == [f"{REPO}:{tag}"] and ref.startswith(f"{REPO}@sha256:")


def test_prebuilt_image_is_passed_through_without_a_build():
    prebuilt = "ghcr.io/acme/trainer@sha256:" + "b" * 64
    monitor, ref, tag = _run(prebuilt)
    assert ref == prebuilt
    assert tag == ""
    assert _image_inputs(monitor) == []
    types = {urn.split("::")[-2].split("$")[-1] for urn in monitor.get_registered_resources()}
    assert types == {"gpu-train:image:TrainerImage"}
