"""In-cluster admission for team namespaces: the policy pack's pod rules, enforced by the API server itself
with Kubernetes' built-in ValidatingAdmissionPolicy (admissionregistration.k8s.io/v1, GA in 1.30).

Usage (infra/k8s/__init__.py):
    PodAdmission("pod-admission", PodAdmissionArgs(platform=platform, extra_repositories=(prebuilt_repo,)))
    admission_policies(nvme_host_path="/mnt/k8s-disks/0", registries=["<registry>/"])  # the manifests, pure

Why: team namespaces enforce the Pod Security level `privileged` (training pods mount their NVMe work
directory and GPUDirect pods run a privileged receive-datapath sidecar, which every stricter level
refuses), and the policy pack only sees what Pulumi creates. Without these policies a submitter could
`kubectl apply` a privileged hostPath pod on a shared GPU node. With them, every Pod, Job and JobSet
created or updated in a namespace labelled `gpu-train.io/team` must, like the pack's rules
(policies/pods.py `host_isolation_problems` and `training_problems`, policies/kubernetes.py
`training_image_digest`):
- share no host namespace (hostNetwork, hostPID, hostIPC) and bind no hostPort;
- mount host paths only for the namespace's own NVMe work directory (`<nvme>/gpu-train/<namespace>`),
  GKE's GPU driver and NCCL plugin directories read-only, and TCPXO's `/dev/aperture_devices`;
- run every container as non-root, without privilege escalation, with every capability dropped (only
  NET_BIND_SERVICE may be added) and a RuntimeDefault or Localhost seccomp profile, never privileged;
- run images pinned by digest and only from the platform's registry (the trainer's registry, the registries of
  the stack's image.allowedRegistries, and the prebuilt image's repository when the stack names one):
  `registry_problems` is that rule in Python. Where the stack serves models, KServe's model server and storage
  initializer, by container name and exact pinned image (`pod_rules.SERVING_IMAGES`), are exempt from these two
  image rules and from nothing else.
The one exemption is the pack's: Google's GPUDirect receive-datapath sidecars (`policies.pods.RXDM_SIDECARS`),
matched by container name and image repository, may be privileged and mount `/sys`, `/proc/sys` and the
driver directory, and run Google's tagged image. Nothing else is exempt in a team namespace.

One rule definition, two enforcement points: the CEL below is generated from the pack's own data
(RXDM_SIDECARS, READ_ONLY_HOST_PATHS, DEVICE_HOST_PATHS, RESTRICTED_ADDABLE, SECCOMP_OK), and
tests/infra/k8s/test_pod_admission.py evaluates it with cel-python on the same objects the pack's Python
functions judge and asserts the verdicts agree. The one documented difference: the pack normalises a host
path before comparing it (`/a/./b`, `/a//b`), the admission policy compares it as written (a trailing
slash aside), so it refuses such spellings of an allowed path; it never admits what the pack refuses.

CEL is written for both evaluators: standard CEL only (no optional fields, no Kubernetes library
functions), every field guarded with has() before it is read, and each container list (init, regular,
ephemeral) walked on its own, since Kubernetes types them differently.
https://kubernetes.io/docs/reference/access-authn-authz/validating-admission-policy/
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from gpu_train.spec import naming
from gpu_train.spec import pod_rules as pods
from gpu_train.spec.pod_rules import registry_prefix
from infra.platform import ClusterPlatform

VAP_API = "admissionregistration.k8s.io/v1"
POLICY_PREFIX = "gpu-train-team"
# Where each admitted kind keeps its pod specs, as a CEL list.
SPEC_LISTS: dict[str, tuple[tuple[str, str, str], str]] = {
    # kind: ((apiGroup, version, resource), CEL list of pod specs)
    "Pod": (("", "v1", "pods"), "[object.spec]"),
    "Job": (("batch", "v1", "jobs"), "[object.spec.template.spec]"),
    "JobSet": (("jobset.x-k8s.io", "v1alpha2", "jobsets"),
               "has(object.spec.replicatedJobs) ? object.spec.replicatedJobs.map(r, r.template.spec.template.spec) "
               ": []"),
}
CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")
_DIGEST = "@sha256:[0-9a-f]{64}$"


def _q(text: str) -> str:
    """A CEL string literal."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _list(values: Sequence[str]) -> str:
    return "[" + ", ".join(_q(v) for v in values) + "]"


def _spellings(paths: Sequence[str]) -> list[str]:
    """A host path as the pack accepts it after normalising: as written, or with a trailing slash."""
    return sorted({q for p in paths for q in (p, p.rstrip("/") + "/")})


def _caps_regex(names: Sequence[str]) -> str:
    """A capability name as the pack normalises it: any case, with or without the CAP_ prefix."""
    return "(?i)^(cap_)?(" + "|".join(re.escape(n) for n in sorted(names)) + ")$"


def _image_is(c: str, repository: str) -> str:
    """The container's image is this repository (any tag or digest), as policies.pods.image_repository reads it."""
    r = _q(repository)
    return (f"(has({c}.image) && ({c}.image == {r} || {c}.image.startsWith({_q(repository + ':')}) || "
            f"{c}.image.startsWith({_q(repository + '@')})))")


def _granted(c: str, test: Callable[[pods.ContainerGrant], str | None]) -> str:
    """CEL true when container `c` holds a GPUDirect sidecar grant for which `test` gives a condition."""
    terms = []
    for name, grant in sorted(pods.RXDM_SIDECARS.items()):
        cond = test(grant)
        if cond is not None:
            terms.append(f"({c}.name == {_q(name)} && {_image_is(c, grant.image)} && {cond})")
    return "(" + " || ".join(terms) + ")" if terms else "false"


def granted_privileged(c: str) -> str:
    return _granted(c, lambda g: "true" if g.privileged else None)


def granted_any(c: str) -> str:
    return _granted(c, lambda g: "true")


def granted_path(c: str, path: str) -> str:
    return _granted(c, lambda g: f"{path} in {_list(_spellings(sorted(g.host_paths)))}" if g.host_paths else None)


def granted_capability(c: str, cap: str) -> str:
    return _granted(c, lambda g: f"{cap}.matches({_q(_caps_regex(sorted(g.capabilities)))})" if g.capabilities
                    else None)


def each_container(s: str, pred: Callable[[str], str], quantifier: str = "all") -> str:
    """`pred` over every container of pod spec `s` (init, regular, ephemeral): all of them, or any."""
    parts = []
    for kind in CONTAINER_LISTS:
        body = f"{s}.{kind}.{quantifier}(c, {pred('c')})"
        parts.append(f"(!has({s}.{kind}) || {body})" if quantifier == "all" else f"(has({s}.{kind}) && {body})")
    return "(" + (" && " if quantifier == "all" else " || ").join(parts) + ")"


def _field(obj: str, *path: str) -> str:
    """has() guards down a path of optional fields, then the test of the last one's presence."""
    guards = [f"has({obj}.{'.'.join(path[:i])})" for i in range(1, len(path) + 1)]
    return "(" + " && ".join(guards) + ")"


def _sc(c: str, *rest: str) -> str:
    return _field(c, "securityContext", *rest)


@dataclass(frozen=True)
class Rule:
    name: str  # validation name (the message starts with it)
    expression: str  # CEL over one pod spec bound to `s` (and `request`)
    message: str


def serving_image(c: str, images: Mapping[str, Sequence[str]]) -> str:
    """CEL true when container `c` is one of KServe's by name, running exactly its pinned image
    (gpu_train.spec.pod_rules.SERVING_IMAGES)."""
    terms = [f"({c}.name == {_q(name)} && has({c}.image) && {c}.image in {_list(sorted(refs))})"
             for name, refs in sorted(images.items())]
    return "(" + " || ".join(terms) + ")"


def rules(*, nvme_host_path: str, registries: Sequence[str], repositories: Sequence[str] = (),
          serving_images: Mapping[str, Sequence[str]] | None = None) -> list[Rule]:
    """The pod rules of a team namespace as CEL over one pod spec `s`.

    nvme_host_path: the cluster's NVMe root (ClusterPlatform.nvme_host_path); the namespace's work directory
    is naming.workdir_path(root, request.namespace). registries: image prefixes ("<registry>/"); repositories:
    single repositories allowed besides (the stack's prebuilt trainer image); serving_images: where the stack
    serves models, KServe's containers and their exact pinned images, exempt from the image rules only."""
    workdir = _q(naming.workdir_path(nvme_host_path, ""))  # "<root>/gpu-train/": the namespace follows
    addable = _caps_regex(sorted(pods.RESTRICTED_ADDABLE))

    def host_path_ok(v: str) -> str:
        p = f"{v}.hostPath.path"
        mounts = lambda c: f"(has({c}.volumeMounts) && {c}.volumeMounts.exists(m, m.name == {v}.name))"  # noqa: E731
        read_only = each_container("s", lambda c: (
            f"(!has({c}.volumeMounts) || {c}.volumeMounts.all(m, m.name != {v}.name || "
            f"(has(m.readOnly) && m.readOnly) || {granted_path(c, p)}))"))
        any_mount = each_container("s", mounts, "exists")
        all_granted = each_container("s", lambda c: f"(!{mounts(c)} || {granted_path(c, p)})")
        any_granted = each_container("s", lambda c: granted_path(c, p), "exists")
        return (f"({p} == {workdir} + request.namespace || {p} == {workdir} + request.namespace + '/' || "
                f"{p} in {_list(_spellings(sorted(pods.DEVICE_HOST_PATHS)))} || "
                f"({p} in {_list(_spellings(sorted(pods.READ_ONLY_HOST_PATHS)))} && {read_only}) || "
                f"({any_mount} && {all_granted}) || (!{any_mount} && {any_granted}))")

    def image_allowed(c: str) -> str:
        terms = [f"{c}.image.startsWith({_q(prefix)})" for prefix in registries]
        terms += [f"({c}.image == {_q(r)} || {c}.image.startsWith({_q(r + ':')}) || {c}.image.startsWith({_q(r + '@')}))"
                  for r in repositories]
        return f"(has({c}.image) && ({' || '.join(terms) or 'false'}))"

    def non_root(c: str) -> str:
        return (f"({_sc(c, 'runAsNonRoot')} ? {c}.securityContext.runAsNonRoot : "
                f"{_sc('s', 'runAsNonRoot')} && s.securityContext.runAsNonRoot)")

    def not_uid0(c: str) -> str:
        return (f"({_sc(c, 'runAsUser')} ? {c}.securityContext.runAsUser != 0 : "
                f"!({_sc('s', 'runAsUser')} && s.securityContext.runAsUser == 0))")

    seccomp_ok = _list(pods.SECCOMP_OK)
    kserve = (lambda c: f" || {serving_image(c, serving_images)}") if serving_images else (lambda c: "")

    def seccomp(c: str) -> str:
        return (f"({_sc(c, 'seccompProfile', 'type')} ? {c}.securityContext.seccompProfile.type in {seccomp_ok} : "
                f"{_sc('s', 'seccompProfile', 'type')} && s.securityContext.seccompProfile.type in {seccomp_ok})")

    def unless_privileged_sidecar(test: Callable[[str], str]) -> Callable[[str], str]:
        return lambda c: f"({granted_privileged(c)} || {test(c)})"

    return [
        Rule("host-namespaces",
             "!(has(s.hostNetwork) && s.hostNetwork) && !(has(s.hostPID) && s.hostPID) && "
             "!(has(s.hostIPC) && s.hostIPC)",
             "host-namespaces: a pod in a team namespace may not share the node's network, process or IPC "
             "namespace (hostNetwork, hostPID, hostIPC)"),
        Rule("host-ports",
             each_container("s", lambda c: f"(!has({c}.ports) || {c}.ports.all(p, !has(p.hostPort) || p.hostPort == 0))"),
             "host-ports: a container in a team namespace may not bind a hostPort"),
        Rule("host-paths",
             f"!has(s.volumes) || s.volumes.all(v, !has(v.hostPath) || {host_path_ok('v')})",
             "host-paths: a pod in a team namespace may mount from the node only its own namespace's NVMe work "
             f"directory ({naming.workdir_path(nvme_host_path, '<namespace>')}), the GPU driver and NCCL plugin "
             "directories read-only and /dev/aperture_devices; the GPUDirect sidecars also /sys and /proc/sys"),
        Rule("privileged",
             each_container("s", unless_privileged_sidecar(
                 lambda c: f"!({_sc(c, 'privileged')} && {c}.securityContext.privileged)")),
             "privileged: only the GPUDirect receive-datapath sidecars (tcpx-daemon, tcpxo-daemon, with Google's "
             "image) may be privileged in a team namespace"),
        Rule("capabilities",
             each_container("s", unless_privileged_sidecar(
                 lambda c: f"(!{_sc(c, 'capabilities', 'add')} || {c}.securityContext.capabilities.add.all(x, "
                           f"x.matches({_q(addable)}) || {granted_capability(c, 'x')}))")),
             "capabilities: a container in a team namespace may add only NET_BIND_SERVICE"),
        Rule("non-root",
             each_container("s", unless_privileged_sidecar(lambda c: f"({non_root(c)} && {not_uid0(c)})")),
             "non-root: every container in a team namespace needs runAsNonRoot true (pod or container) and a "
             "user other than 0"),
        Rule("privilege-escalation",
             each_container("s", unless_privileged_sidecar(
                 lambda c: f"({_sc(c, 'allowPrivilegeEscalation')} && "
                           f"{c}.securityContext.allowPrivilegeEscalation == false)")),
             "privilege-escalation: every container in a team namespace needs allowPrivilegeEscalation false"),
        Rule("drop-all",
             each_container("s", unless_privileged_sidecar(
                 lambda c: f"({_sc(c, 'capabilities', 'drop')} && {c}.securityContext.capabilities.drop.exists(x, "
                           f"x.matches({_q(_caps_regex(['ALL']))})))")),
             "drop-all: every container in a team namespace must drop ALL capabilities"),
        Rule("seccomp",
             each_container("s", unless_privileged_sidecar(seccomp)),
             "seccomp: every container in a team namespace needs seccompProfile RuntimeDefault or Localhost "
             "(pod or container)"),
        Rule("image-digest",
             each_container("s", lambda c: f"({granted_any(c)}{kserve(c)} || (has({c}.image) && "
                                           f"{c}.image.matches({_q(_DIGEST)})))"),
             "image-digest: images in a team namespace must be pinned by digest (image@sha256:...)"),
        Rule("image-registry",
             each_container("s", lambda c: f"({granted_any(c)}{kserve(c)} || {image_allowed(c)})"),
             "image-registry: images in a team namespace must come from the platform's registry ("
             + ", ".join([*registries, *repositories]) + ")"),
    ]


def policy_name(kind: str) -> str:
    return f"{POLICY_PREFIX}-{kind.lower()}s"


def team_namespace_selector() -> dict[str, Any]:
    """Every team namespace: they carry the team label (tenancy.namespace_labels)."""
    return {"matchExpressions": [{"key": naming.TEAM_LABEL, "operator": "Exists"}]}


def admission_policies(*, nvme_host_path: str, registries: Sequence[str], repositories: Sequence[str] = (),
                       serving_images: Mapping[str, Sequence[str]] | None = None) -> list[dict[str, Any]]:
    """A ValidatingAdmissionPolicy and its Binding (Deny) per admitted kind: Pods (what finally runs),
    Jobs and JobSets (what a team member submits, refused at submission rather than when its pods are made)."""
    checks = rules(nvme_host_path=nvme_host_path, registries=registries, repositories=repositories,
                   serving_images=serving_images)
    out = []
    for kind, ((group, version, resource), specs) in SPEC_LISTS.items():
        name = policy_name(kind)
        out.append({
            "apiVersion": VAP_API, "kind": "ValidatingAdmissionPolicy",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "gpu-train"}},
            "spec": {
                "failurePolicy": "Fail",
                "matchConstraints": {
                    "namespaceSelector": team_namespace_selector(),
                    "resourceRules": [{"apiGroups": [group], "apiVersions": [version], "resources": [resource],
                                       "operations": ["CREATE", "UPDATE"]}],
                },
                "variables": [{"name": "specs", "expression": specs}],
                "validations": [{"expression": f"variables.specs.all(s, {r.expression})", "message": r.message,
                                 "reason": "Forbidden"} for r in checks],
            },
        })
        out.append({
            "apiVersion": VAP_API, "kind": "ValidatingAdmissionPolicyBinding",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "gpu-train"}},
            "spec": {"policyName": name, "validationActions": ["Deny"],
                     "matchResources": {"namespaceSelector": team_namespace_selector()}},
        })
    return out


@dataclass(frozen=True, kw_only=True)
class PodAdmissionArgs:
    platform: ClusterPlatform  # the NVMe root, the registry, the Kubernetes provider
    # Image repositories allowed besides the platform registry (the stack's image.prebuilt repository).
    extra_repositories: Sequence[str] = ()
    # Where the stack serves models: KServe's containers and their pinned images (pod_rules.SERVING_IMAGES).
    serving_images: Mapping[str, Sequence[str]] = field(default_factory=dict)
    # Registries allowed besides the platform's, as image prefixes (the stack's image.allowedRegistries).
    extra_registries: Sequence[str] = ()


class PodAdmission(pulumi.ComponentResource):
    """The team namespaces' ValidatingAdmissionPolicies and their Bindings."""

    def __init__(self, name: str, args: PodAdmissionArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:k8s:PodAdmission", name, None, opts)
        p = args.platform
        manifests = pulumi.Output.from_input(p.registry.repository).apply(lambda repo: admission_policies(
            nvme_host_path=p.nvme_host_path, registries=[registry_prefix(repo), *args.extra_registries],
            repositories=list(args.extra_repositories), serving_images=args.serving_images))
        k8s_opts = pulumi.ResourceOptions(parent=self, provider=p.provider, depends_on=list(p.ready))
        self.policies = []
        for i, kind in enumerate(SPEC_LISTS):
            policy = k8s.admissionregistration.v1.ValidatingAdmissionPolicy(
                f"{name}-{kind.lower()}", metadata={"name": policy_name(kind),
                                                    "labels": {"app.kubernetes.io/part-of": "gpu-train"}},
                spec=manifests.apply(lambda m, i=i: m[2 * i]["spec"]), opts=k8s_opts)
            k8s.admissionregistration.v1.ValidatingAdmissionPolicyBinding(
                f"{name}-{kind.lower()}-binding", metadata={"name": policy_name(kind),
                                                            "labels": {"app.kubernetes.io/part-of": "gpu-train"}},
                spec=manifests.apply(lambda m, i=i: m[2 * i + 1]["spec"]),
                opts=pulumi.ResourceOptions.merge(k8s_opts, pulumi.ResourceOptions(depends_on=[policy])))
            self.policies.append(policy)
        self.register_outputs({"policies": [policy_name(k) for k in SPEC_LISTS]})
