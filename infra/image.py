"""The trainer's container image: built from trainer/Dockerfile and pushed to the stack's registry.

Usage (in infra/__main__.py):
    image = TrainerImage("trainer", TrainerImageArgs(registry=platform.registry, prebuilt=cfg.image.prebuilt))
    image.ref   # Output[str]: <repository>@sha256:<digest>, what the JobSet runs
    image_inputs()  # the context files the image is made from (what the tag hashes)

With `prebuilt` set (already validated with the settings as repo@sha256:<64 hex>) nothing is built and
the reference passes through. Otherwise pulumi-docker-build (BuildKit) builds the repository root with
trainer/Dockerfile for linux/amd64 and pushes it with the registry credentials from the cloud layer.
When the cloud layer names a cache repository (`Registry.cache_repository`), the layer cache is read
from and written to <cache repository>:buildcache (mode max, so the builder stage's torch layer is
cached too); that tag is rewritten by every build, so it lives apart from the image repository,
whose tags are immutable. Without one, the build uses no registry cache.

The tag is a content hash (`context_hash`) of exactly what goes into the image: the Dockerfile, and
every file of the build context that one of its COPY / ADD instructions (or a RUN bind mount of the
context) takes, after .dockerignore. Registries such as ECR keep tags immutable, so a tag must never
be reused for different contents; an unchanged image keeps its tag, so `pulumi up` does not rebuild,
and a change to a file the image does not contain (docs, tests, infra) does not change the tag.
The README is not an input: pyproject.toml declares it as the package's long description, and the
Dockerfile writes a one-line one instead of copying the project's, so a README edit neither rebuilds the
image nor replaces a running JobSet. Which context files exist after .dockerignore is
decided by docker-py's implementation of the .dockerignore rules (`docker.utils.build.exclude_paths`)
and the Dockerfile is read with `dockerfile_parse`; what remains here is the small step neither library
does: mapping COPY sources onto those files.
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import shlex
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import pulumi
import pulumi_docker_build as docker_build
from docker.utils.build import exclude_paths
from dockerfile_parse import DockerfileParser

from infra.platform import Registry

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = "trainer/Dockerfile"
CACHE_TAG = "buildcache"
TAG_LENGTH = 32  # hex characters of the content hash used as the image tag


def _context_files(root: Path) -> list[str]:
    """Files BuildKit may send: the context root minus .dockerignore (POSIX paths relative to root)."""
    ignore = root / ".dockerignore"
    patterns = ignore.read_text().splitlines() if ignore.is_file() else []
    return sorted(p for p in exclude_paths(str(root), patterns) if (root / p).is_file())


def _copy_sources(dockerfile: Path, name: str) -> list[tuple[int, str]]:
    """(line, source) for every context source the Dockerfile reads: COPY/ADD without --from, and RUN
    bind mounts without from= (which mount the context)."""
    sources: list[tuple[int, str]] = []
    for ins in DockerfileParser(str(dockerfile)).structure:
        line = ins["startline"] + 1
        if ins["instruction"] in ("COPY", "ADD"):
            words = shlex.split(ins["value"])
            if any(w.startswith("--from=") for w in words):
                continue
            args = [w for w in words if not w.startswith("--")]
            if args and args[0].startswith("["):
                raise ValueError(f"{name}:{line}: JSON-form {ins['instruction']} is not supported here")
            for src in args[:-1]:
                if "://" in src or "$" in src:
                    raise ValueError(f"{name}:{line}: source {src!r} is not a plain context path, so the "
                                     "image tag could not follow its content")
                sources.append((line, src))
        elif ins["instruction"] == "RUN":
            # Only the leading flags: the rest is a shell command.
            for w in ins["value"].split():
                if not w.startswith("--"):
                    break
                if w.startswith("--mount="):
                    opts = dict(kv.split("=", 1) if "=" in kv else (kv, "") for kv in w[len("--mount="):].split(","))
                    if opts.get("type", "bind") == "bind" and "from" not in opts:
                        sources.append((line, opts.get("source", opts.get("src", "."))))
    return sources


def _matches(path: str, source: str) -> bool:
    """True if context file `path` is taken by COPY source `source` (a file, a directory, or a pattern
    whose `*`, `?` and `[...]` stay within one path segment, as Go's filepath.Match does)."""
    src = PurePosixPath(os.path.normpath(source)).as_posix().lstrip("/")
    if src in ("", "."):
        return True
    parts, pattern = PurePosixPath(path).parts, PurePosixPath(src).parts
    if len(parts) < len(pattern):
        return False
    return all(fnmatch.fnmatchcase(p, q) for p, q in zip(parts, pattern, strict=False))


def image_inputs(root: Path = ROOT, dockerfile: str = DOCKERFILE) -> list[str]:
    """The context files the image is built from, sorted; raises naming a COPY source that matches nothing."""
    path = root / dockerfile
    if not path.is_file():
        raise FileNotFoundError(f"image build input {dockerfile!r} does not exist under {root}")
    files = _context_files(root)
    taken: set[str] = set()
    for line, src in _copy_sources(path, dockerfile):
        hits = [f for f in files if _matches(f, src)]
        if not hits:
            raise FileNotFoundError(f"image build input {src!r} ({dockerfile}:{line}) does not exist under {root} "
                                    "or is excluded by .dockerignore")
        taken.update(hits)
    return sorted(taken)


def context_hash(root: Path = ROOT, dockerfile: str = DOCKERFILE) -> str:
    """sha256 (hex) over the Dockerfile and the path, executable bit and bytes of every image input."""
    digest = hashlib.sha256()
    entries = [(dockerfile, root / dockerfile)] + [(rel, root / rel) for rel in image_inputs(root, dockerfile)]
    for rel, path in entries:
        data = path.read_bytes()
        # Git records only the executable bit (other mode bits follow the checkout's umask), and COPY
        # keeps it, so it is part of the content.
        mode = b"x" if os.access(path, os.X_OK) else b"-"
        name = rel.encode()
        # Length-prefix each part so ("ab", "c") and ("a", "bc") can never hash alike.
        digest.update(len(name).to_bytes(8, "big") + name + mode + len(data).to_bytes(8, "big") + data)
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
        cache_from: list[docker_build.CacheFromArgs] = []
        cache_to: list[docker_build.CacheToArgs] = []
        if args.registry.cache_repository is not None:
            cache_ref = pulumi.Output.from_input(args.registry.cache_repository).apply(lambda r: f"{r}:{CACHE_TAG}")
            cache_from = [docker_build.CacheFromArgs(registry=docker_build.CacheFromRegistryArgs(ref=cache_ref))]
            # ECR accepts a registry cache only as an OCI image manifest
            # (https://aws.amazon.com/blogs/containers/announcing-remote-cache-support-in-amazon-ecr-for-buildkit-clients/).
            cache_to = [docker_build.CacheToArgs(registry=docker_build.CacheToRegistryArgs(
                ref=cache_ref, mode=docker_build.CacheMode.MAX, image_manifest=True, oci_media_types=True,
            ))]
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
            cache_from=cache_from,
            cache_to=cache_to,
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.tag = pulumi.Output.from_input(tag)
        self.ref = pulumi.Output.all(repo, self.image.digest).apply(lambda v: pinned_ref(v[0], v[1]))
        self.register_outputs({"ref": self.ref, "tag": self.tag})
