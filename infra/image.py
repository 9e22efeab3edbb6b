"""The trainer's container image: built from trainer/Dockerfile and pushed to the stack's registry.

Usage (in infra/__main__.py):
    image = TrainerImage("trainer", TrainerImageArgs(registry=platform.registry, prebuilt=cfg.image.prebuilt))
    image.ref   # Output[str]: <repository>@sha256:<digest>, what the JobSet runs

With `prebuilt` set (already validated by infra/config.py as repo@sha256:<64 hex>) nothing is built and
the reference passes through. Otherwise pulumi-docker-build (BuildKit) builds the repository root with
trainer/Dockerfile for linux/amd64, pushes it with the registry credentials from the cloud layer, and
reads and writes the layer cache at <repository>:buildcache (mode max, so the builder stage's torch
layer is cached too).

The tag is a content hash of exactly the files the Dockerfile copies (`context_hash`): registries such as
ECR are set to immutable tags, so a tag must never be reused for different contents, and an unchanged
tree keeps the same tag, so `pulumi up` does not rebuild.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pulumi
import pulumi_docker_build as docker_build

from infra.platform import Registry

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = "trainer/Dockerfile"
# Everything the image is made from: the files trainer/Dockerfile COPYs, the Dockerfile and .dockerignore.
IMAGE_INPUTS: tuple[str, ...] = ("trainer", "pyproject.toml", "README.md", ".dockerignore")
_SKIP_DIRS = {"__pycache__", ".pytest_cache", ".ruff_cache"}
_SKIP_SUFFIXES = {".pyc", ".pyo"}
CACHE_TAG = "buildcache"
TAG_LENGTH = 32  # hex characters of the content hash used as the image tag


def _files(root: Path, inputs: Sequence[str]) -> list[Path]:
    files: list[Path] = []
    for rel in inputs:
        path = root / rel
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files.extend(
                p for p in path.rglob("*")
                if p.is_file() and not _SKIP_DIRS.intersection(p.relative_to(root).parts)
                and p.suffix not in _SKIP_SUFFIXES
            )
        else:
            raise FileNotFoundError(f"image build input {rel!r} does not exist under {root}")
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def context_hash(root: Path = ROOT, inputs: Sequence[str] = IMAGE_INPUTS) -> str:
    """sha256 (hex) over the relative path and bytes of every image input file, in a fixed order."""
    digest = hashlib.sha256()
    for path in _files(root, inputs):
        rel = path.relative_to(root).as_posix().encode()
        data = path.read_bytes()
        # Length-prefix both parts so ("ab", "c") and ("a", "bc") can never hash alike.
        digest.update(len(rel).to_bytes(8, "big") + rel + len(data).to_bytes(8, "big") + data)
    return digest.hexdigest()


def image_tag(root: Path = ROOT) -> str:
    return context_hash(root)[:TAG_LENGTH]


def pinned_ref(repository: str, digest: str) -> str:
    """repo@sha256:<hex>; rejects anything that is not a sha256 digest (an unpinned image is never run)."""
    if not digest.startswith("sha256:") or len(digest) != len("sha256:") + 64:
        raise ValueError(f"image digest for {repository} must be sha256:<64 hex> (got {digest!r})")
    return f"{repository}@{digest}"


@dataclass(frozen=True, kw_only=True)
class TrainerImageArgs:
    registry: Registry  # where to push, with credentials (platform.registry)
    prebuilt: str = ""  # digest-pinned image to use instead of building (cfg.image.prebuilt)
    context: str = str(ROOT)  # build context: the repository root
    platform: str = "linux/amd64"  # GPU nodes are x86_64 (p5, g6, a3, g2)


class TrainerImage(pulumi.ComponentResource):
    """Builds and pushes the trainer image (or passes a prebuilt one through); `ref` is digest-pinned."""

    ref: pulumi.Output[str]
    tag: pulumi.Output[str]

    def __init__(self, name: str, args: TrainerImageArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:image:TrainerImage", name, None, opts)
        if args.prebuilt:
            self.ref = pulumi.Output.from_input(args.prebuilt)
            self.tag = pulumi.Output.from_input("")
            self.register_outputs({"ref": self.ref, "prebuilt": True})
            return

        tag = image_tag(Path(args.context))
        repo = args.registry.repository
        cache_ref = repo.apply(lambda r: f"{r}:{CACHE_TAG}")
        self.image = docker_build.Image(
            f"{name}-image",
            context=docker_build.BuildContextArgs(location=args.context),
            dockerfile=docker_build.DockerfileArgs(location=str(Path(args.context) / DOCKERFILE)),
            platforms=[docker_build.Platform(args.platform)],
            tags=[repo.apply(lambda r: f"{r}:{tag}")],
            build_args={"REVISION": tag},
            push=True,
            registries=[docker_build.RegistryArgs(
                address=args.registry.server,
                username=args.registry.username,
                password=pulumi.Output.secret(args.registry.password),
            )],
            cache_from=[docker_build.CacheFromArgs(registry=docker_build.CacheFromRegistryArgs(ref=cache_ref))],
            # ECR accepts a registry cache only as an OCI image manifest
            # (https://aws.amazon.com/blogs/containers/announcing-remote-cache-support-in-amazon-ecr-for-buildkit-clients/).
            cache_to=[docker_build.CacheToArgs(registry=docker_build.CacheToRegistryArgs(
                ref=cache_ref, mode=docker_build.CacheMode.MAX, image_manifest=True, oci_media_types=True,
            ))],
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.tag = pulumi.Output.from_input(tag)
        self.ref = pulumi.Output.all(repo, self.image.digest).apply(lambda v: pinned_ref(v[0], v[1]))
        self.register_outputs({"ref": self.ref, "tag": self.tag})
