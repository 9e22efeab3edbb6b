"""The team namespaces' ValidatingAdmissionPolicies (infra/k8s/pod_admission.py) against the policy pack's pod
rules: one rule definition in spirit, two enforcement points, judged on the same objects.

Every object here is a training pod the platform itself renders (gpu_train.jobs.jobset, on the pools the cloud
layers describe: EFA, or the real GPUDirect fabric of infra/gcp/fabric.py) or a copy broken in one way, as a Pod, a Job and a JobSet,
each checked to be a valid object for the API server first (kubernetes-validate strict, the JobSet CRD). The
pack judges it with its own functions (policies.pods.host_isolation_problems with the cluster's NVMe root,
policies.pods.training_problems, policies.kubernetes.training_image_digest, and the registry rule
policies.pods.registry_problems); the admission policy's CEL is evaluated with cel-python (tests/infra/k8s/vap.py).
Both must agree with the expected verdict, and the policy must deny through the expected rule.

Run: .venv/bin/pytest tests/infra/k8s/test_pod_admission.py -q
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import kubernetes_validate
import pytest

from gpu_train.jobs import jobset as js
from gpu_train.spec import naming, pod_rules
from gpu_train.spec.job import JobSpec
from gpu_train.spec.settings_checks import PLATFORM_MIN_KUBERNETES
from infra.aws import node_addons as aws_addons
from infra.aws import settings_checks as aws_checks
from infra.aws.gpu_nodes import NVME_HOST_PATH as AWS_ROOT
from infra.gcp import NVME_HOST_PATH as GCP_ROOT
from infra.gcp import node_addons as gcp_addons
from infra.gcp import settings_checks as gcp_checks
from infra.k8s import pod_admission
from infra.plan import kubernetes_objects
from policies import kubernetes as pack_kubernetes
from policies import pods
from policies.core import Resource
from tests.conftest import STACKS, VARIANTS
from tests.infra.aws.conftest import stack_cfg as aws_stack
from tests.infra.gcp.conftest import fabric_pool
from tests.infra.gcp.conftest import stack_cfg as gcp_stack
from tests.infra.k8s.vap import Admission
from tools.validation import crd

ECR = "123456789012.dkr.ecr.us-east-1.amazonaws.com/"
AR = "us-central1-docker.pkg.dev/acme-ml/gpu-train-gcp-prod-images/"
DIGEST = "@sha256:" + "ab" * 32
NS = "team-research"
K8S = "1.33"


@functools.cache
def _pool(kind: str):
    """A pool named h100 of the fabric kind, as its cloud layer describes it to jobs."""
    if kind == "efa":
        (pool,) = aws_addons.gpu_pools(aws_stack([{
            "name": "h100", "instanceType": "p5.48xlarge", "capacity": "reservation", "reservationId": "cr-0123456789abcdef0",
            "maxNodes": 4, "fabric": True, "zone": "us-west-2a"}]))
        return pool
    machine = {"tcpx": "a3-highgpu-8g", "tcpxo": "a3-megagpu-8g", "rdma": "a3-ultragpu-8g"}[kind]
    (pool,) = gcp_addons.gpu_pools(gcp_stack([{**fabric_pool("h100", machine, capacity="reservation"),
                                               "maxNodes": 4}]))
    assert pool.fabric.kind == kind
    return pool


def base_jobset(kind: str) -> dict:
    job = JobSpec.model_validate({"name": "llm", "team": "research", "pool": "h100", "preset": "gpt2-124m",
                                  "nodes": "2:4"})
    aws = kind == "efa"
    bucket = "s3://b" if aws else "gs://b"
    # A copy: the cases below break it in place, and the manifest shares its fabric parts with the pool.
    return copy.deepcopy(js.jobset(job, js.Placement(
        pool=_pool(kind), image=(ECR if aws else AR) + "trainer" + DIGEST, queue="research-queue",
        nvme_host_path=AWS_ROOT if aws else GCP_ROOT, datasets_bucket=bucket, checkpoints_bucket=bucket,
        pod_env={"AWS_REGION": "r"} if aws else {})))


def _template(jobset: dict) -> dict:
    return jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]


def as_kind(jobset: dict, kind: str) -> dict:
    tpl = copy.deepcopy(_template(jobset))
    meta = {"name": "llm-worker-0-0-abcde", "namespace": NS, **tpl["metadata"]}
    if kind == "Pod":
        return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": tpl["spec"]}
    if kind == "Job":
        return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "llm-worker-0", "namespace": NS},
                "spec": {"completionMode": "Indexed", "completions": 2, "parallelism": 2, "template": tpl}}
    return copy.deepcopy(jobset)


def pod_spec_of(obj: dict) -> dict:
    return obj["spec"] if obj["kind"] == "Pod" else (
        obj["spec"]["template"]["spec"] if obj["kind"] == "Job"
        else obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"])


def valid(obj: dict) -> None:
    if obj["kind"] == "JobSet":
        assert crd.validate(obj).problems == [], crd.validate(obj).problems
    else:
        kubernetes_validate.validate(obj, K8S, strict=True)


def pack_problems(obj: dict, root: str, registries: list[str]) -> list[str]:
    res = Resource(type=f"kubernetes:{obj['apiVersion'] if '/' in obj['apiVersion'] else 'core/v1'}:{obj['kind']}",
                   name="x", urn="urn:x", props=obj)
    return [*pods.host_isolation_problems(obj, nvme_roots=(root,)), *pods.training_problems(obj),
            *pack_kubernetes.training_image_digest(res, None), *pods.registry_problems(obj, registries)]


def policies_for(kind: str) -> tuple[Admission, str, list[str]]:
    root, registries = (AWS_ROOT, [ECR]) if kind == "efa" else (GCP_ROOT, [AR])
    return Admission(pod_admission.admission_policies(nvme_host_path=root, registries=registries)), root, registries


# ------------------------------------------------------------------------------------------ mutations

def trainer(spec: dict) -> dict:
    return next(c for c in spec["containers"] if c["name"] == js.CONTAINER)


def sidecar(spec: dict) -> dict:
    return spec["initContainers"][0]


def host_vol(path: str, name: str = "extra", mount_in: str | None = "trainer", read_only: bool = False):
    def mutate(spec: dict) -> None:
        spec["volumes"].append({"name": name, "hostPath": {"path": path}})
        if mount_in == "trainer":
            trainer(spec)["volumeMounts"].append({"name": name, "mountPath": "/extra", "readOnly": read_only})
        elif mount_in == "sidecar":
            sidecar(spec)["volumeMounts"].append({"name": name, "mountPath": "/extra", "readOnly": read_only})
    return mutate


def sc(container: Callable[[dict], dict], **fields):
    def mutate(spec: dict) -> None:
        target = container(spec).setdefault("securityContext", {})
        for key, value in fields.items():
            if value is None:
                target.pop(key, None)
            else:
                target[key] = value
    return mutate


def pod_sc(**fields):
    def mutate(spec: dict) -> None:
        for key, value in fields.items():
            if value is None:
                spec["securityContext"].pop(key, None)
            else:
                spec["securityContext"][key] = value
    return mutate


def both(*mutations):
    def mutate(spec: dict) -> None:
        for m in mutations:
            m(spec)
    return mutate


def set_field(**fields):
    def mutate(spec: dict) -> None:
        spec.update(fields)
    return mutate


def add_container(where: str, **over):
    def mutate(spec: dict) -> None:
        c = copy.deepcopy(trainer(spec))
        c.update(name="helper", **over)
        c.pop("ports", None)
        if where == "ephemeralContainers":
            c.pop("resources", None)
        spec.setdefault(where, []).append(c)
    return mutate


def image(img: str):
    def mutate(spec: dict) -> None:
        trainer(spec)["image"] = img
    return mutate


def sidecar_image(img: str):
    def mutate(spec: dict) -> None:
        sidecar(spec)["image"] = img
    return mutate


def own_workdir(root: str, suffix: str = "") -> str:
    return naming.workdir_path(root, NS) + suffix


# (id, fabric kind, mutation, denied?, the policy rule that must deny)
CASES = [
    ("efa-as-rendered", "efa", None, False, None),
    ("tcpx-as-rendered", "tcpx", None, False, None),
    ("tcpxo-as-rendered", "tcpxo", None, False, None),
    ("rdma-as-rendered", "rdma", None, False, None),
    ("host-network", "efa", set_field(hostNetwork=True), True, "host-namespaces"),
    ("host-pid", "tcpxo", set_field(hostPID=True), True, "host-namespaces"),
    ("host-ipc", "efa", set_field(hostIPC=True), True, "host-namespaces"),
    ("host-port", "efa", lambda s: trainer(s)["ports"][0].update(hostPort=9400), True, "host-ports"),
    ("host-port-zero", "efa", lambda s: trainer(s)["ports"][0].update(hostPort=0), False, None),
    ("hostpath-root", "efa", host_vol("/"), True, "host-paths"),
    ("hostpath-kubelet", "efa", host_vol("/var/lib/kubelet"), True, "host-paths"),
    ("hostpath-nvme-root", "efa", host_vol(AWS_ROOT), True, "host-paths"),
    ("hostpath-other-team", "efa", host_vol(naming.workdir_path(AWS_ROOT, "team-applied")), True, "host-paths"),
    ("hostpath-traversal", "efa", host_vol(own_workdir(AWS_ROOT, "/../team-applied")), True, "host-paths"),
    ("hostpath-own-workdir", "efa", host_vol(own_workdir(AWS_ROOT)), False, None),
    ("hostpath-own-workdir-slash", "efa", host_vol(own_workdir(AWS_ROOT, "/")), False, None),
    ("hostpath-other-cloud-root", "efa", host_vol(own_workdir(GCP_ROOT)), True, "host-paths"),
    ("driver-lib-read-only", "rdma", host_vol(pod_rules.NVIDIA_HOST_LIB, read_only=True), False, None),
    ("driver-lib-writable", "rdma", host_vol(pod_rules.NVIDIA_HOST_LIB), True, "host-paths"),
    ("gib-writable", "rdma", host_vol(pod_rules.GIB_HOST_DIR, name="gib2"), True, "host-paths"),
    ("aperture-devices", "efa", host_vol("/dev/aperture_devices"), False, None),
    ("sys-in-trainer", "tcpxo", lambda s: trainer(s)["volumeMounts"].append({"name": "sys", "mountPath": "/s"}),
     True, "host-paths"),
    ("sys-in-sidecar", "tcpxo", host_vol("/sys", name="sys2", mount_in="sidecar"), False, None),
    ("sys-declared-unmounted-with-sidecar", "tcpx", host_vol("/proc/sys", name="ps2", mount_in=None), False, None),
    ("sys-declared-unmounted-no-sidecar", "efa", host_vol("/sys", mount_in=None), True, "host-paths"),
    ("sidecar-other-image", "tcpxo", sidecar_image("docker.io/library/ubuntu:24.04" + DIGEST), True, "host-paths"),
    ("sidecar-right-image-other-tag", "tcpxo",
     sidecar_image("us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo/tcpgpudmarxd-dev:v9.9.9"), False, None),
    ("privileged-trainer", "efa", sc(trainer, privileged=True), True, "privileged"),
    ("privileged-init", "efa", add_container("initContainers", securityContext={
        "privileged": True, "runAsNonRoot": True, "allowPrivilegeEscalation": True, "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"}}), True, "privileged"),
    ("cap-sys-admin", "efa", sc(trainer, capabilities={"drop": ["ALL"], "add": ["SYS_ADMIN"]}), True, "capabilities"),
    ("cap-net-bind", "efa", sc(trainer, capabilities={"drop": ["ALL"], "add": ["NET_BIND_SERVICE"]}), False, None),
    ("cap-net-bind-lower-prefixed", "efa", sc(trainer, capabilities={"drop": ["ALL"], "add": ["cap_net_bind_service"]}),
     False, None),
    ("cap-net-admin-in-sidecar", "tcpxo", sc(sidecar, capabilities={"add": ["NET_ADMIN"]}), False, None),
    ("non-root-false", "efa", sc(trainer, runAsNonRoot=False), True, "non-root"),
    ("non-root-unset-everywhere", "efa", both(sc(trainer, runAsNonRoot=None), pod_sc(runAsNonRoot=None)), True,
     "non-root"),
    ("non-root-from-pod", "efa", sc(trainer, runAsNonRoot=None), False, None),
    ("uid-0-container", "efa", sc(trainer, runAsUser=0), True, "non-root"),
    ("uid-0-pod-only", "efa", both(sc(trainer, runAsUser=None), pod_sc(runAsUser=0)), True, "non-root"),
    ("uid-0-pod-container-sets-own", "efa", pod_sc(runAsUser=0), False, None),
    ("escalation-unset", "efa", sc(trainer, allowPrivilegeEscalation=None), True, "privilege-escalation"),
    ("escalation-true", "efa", sc(trainer, allowPrivilegeEscalation=True), True, "privilege-escalation"),
    ("drop-nothing", "efa", sc(trainer, capabilities={"drop": ["NET_RAW"]}), True, "drop-all"),
    ("drop-all-lowercase", "efa", sc(trainer, capabilities={"drop": ["all"]}), False, None),
    ("seccomp-unconfined", "efa", sc(trainer, seccompProfile={"type": "Unconfined"}), True, "seccomp"),
    ("seccomp-from-pod", "efa", sc(trainer, seccompProfile=None), False, None),
    ("seccomp-nowhere", "efa", both(sc(trainer, seccompProfile=None), pod_sc(seccompProfile=None)), True, "seccomp"),
    ("seccomp-localhost", "efa", sc(trainer, seccompProfile={"type": "Localhost", "localhostProfile": "p.json"}),
     False, None),
    ("image-tag-only", "efa", image(ECR + "trainer:latest"), True, "image-digest"),
    ("image-docker-hub", "efa", image("docker.io/library/python:3.12" + DIGEST), True, "image-registry"),
    ("image-lookalike-host", "efa", image(ECR.rstrip("/") + ".evil.example/trainer" + DIGEST), True,
     "image-registry"),
    ("image-other-platform-repo", "efa", image(ECR + "team-research/custom" + DIGEST), False, None),
    ("bad-init-container", "efa", add_container("initContainers", image="docker.io/library/busybox" + DIGEST), True,
     "image-registry"),
    ("bad-ephemeral-container", "efa", add_container("ephemeralContainers", securityContext={"privileged": True}),
     True, "privileged"),
]


# cel-python interprets about 0.3 s per object: the fast lane judges every case as a Pod, the full lane also as the
# Job and JobSet around it (the policies' template paths), and the cluster lane all three with the API server's CEL.
FORMS = ["Pod", pytest.param("Job", marks=pytest.mark.integration), pytest.param("JobSet", marks=pytest.mark.integration)]


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(("case", "kind", "mutate", "denied", "rule"), CASES, ids=[c[0] for c in CASES])
def test_the_pack_and_the_admission_policy_agree(case, kind, mutate, denied, rule, form):
    jobset = base_jobset(kind)
    if mutate is not None:
        mutate(_template(jobset)["spec"])
    obj = as_kind(jobset, form)
    valid(obj)
    admission, root, registries = policies_for(kind)
    pack = pack_problems(obj, root, registries)
    vap = admission.denials(obj, NS)
    assert bool(pack) == denied, pack
    assert bool(vap) == denied, vap
    if rule:
        assert any(m.startswith(f"{rule}:") for m in vap), vap


def test_a_non_canonical_spelling_of_an_allowed_path_is_refused_by_admission_only():
    """The documented difference: the pack normalises a host path, the admission policy compares it as written,
    so it is the stricter of the two, never the more lenient."""
    jobset = base_jobset("efa")
    host_vol(naming.workdir_path(AWS_ROOT, "team-research").replace("/gpu-train/", "/gpu-train/./"))(
        _template(jobset)["spec"])
    admission, root, registries = policies_for("efa")
    assert pack_problems(jobset, root, registries) == []
    assert [m.split(":")[0] for m in admission.denials(jobset, NS)] == ["host-paths"]


def test_the_allowed_repositories_besides_the_registry_are_exact():
    jobset = base_jobset("efa")
    image("docker.io/acme/trainer" + DIGEST)(_template(jobset)["spec"])
    extra = Admission(pod_admission.admission_policies(nvme_host_path=AWS_ROOT, registries=[ECR],
                                                       repositories=["docker.io/acme/trainer"]))
    assert extra.denials(jobset, NS) == []
    assert pods.registry_problems(jobset, [ECR], ["docker.io/acme/trainer"]) == []
    image("docker.io/acme/trainer-evil" + DIGEST)(_template(jobset)["spec"])
    assert [m.split(":")[0] for m in extra.denials(jobset, NS)] == ["image-registry"]
    assert pods.registry_problems(jobset, [ECR], ["docker.io/acme/trainer"])


def test_registry_prefix_and_repository_of():
    assert pod_rules.registry_prefix(ECR + "gpu-train-aws-dev-trainer") == ECR
    assert pod_rules.registry_prefix(AR + "trainer") == AR
    with pytest.raises(ValueError, match="no registry"):
        pod_rules.registry_prefix("trainer")
    assert pod_rules.repository_of("reg.io/a/b:1.0@sha256:" + "0" * 64) == "reg.io/a/b"
    assert pod_rules.repository_of("localhost:5000/b@sha256:" + "0" * 64) == "localhost:5000/b"
    assert pod_rules.repository_of("ubuntu:24.04") == "ubuntu"


# Every Kubernetes version a stack may ask for: EKS's, and those of GKE's release channels.
SUPPORTED = {v for v in (*aws_checks.KUBERNETES_VERSIONS, *(v for vs in gcp_checks.KUBERNETES_VERSIONS.values() for v in vs))
             if tuple(map(int, v.split("."))) >= PLATFORM_MIN_KUBERNETES}


@pytest.mark.parametrize("version", sorted(SUPPORTED))
def test_the_policies_are_valid_objects_for_every_supported_kubernetes(version):
    for obj in pod_admission.admission_policies(nvme_host_path=AWS_ROOT, registries=[ECR]):
        kubernetes_validate.validate(obj, version, strict=True)


def test_a_misspelled_policy_field_is_caught_by_strict_validation():
    obj = pod_admission.admission_policies(nvme_host_path=AWS_ROOT, registries=[ECR])[0]
    obj["spec"]["validation"] = obj["spec"].pop("validations")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(obj, K8S, strict=True)


def test_bindings_deny_in_team_namespaces_only():
    objs = pod_admission.admission_policies(nvme_host_path=AWS_ROOT, registries=[ECR])
    bindings = [o for o in objs if o["kind"] == "ValidatingAdmissionPolicyBinding"]
    policies = [o for o in objs if o["kind"] == "ValidatingAdmissionPolicy"]
    assert sorted(b["spec"]["policyName"] for b in bindings) == sorted(p["metadata"]["name"] for p in policies)
    for b in bindings:
        assert b["spec"]["validationActions"] == ["Deny"]
        assert b["spec"]["matchResources"]["namespaceSelector"] == {
            "matchExpressions": [{"key": naming.TEAM_LABEL, "operator": "Exists"}]}
    for p in policies:
        assert p["spec"]["failurePolicy"] == "Fail"
        assert {op for r in p["spec"]["matchConstraints"]["resourceRules"] for op in r["operations"]} == {
            "CREATE", "UPDATE"}
    kinds = {(r["apiGroups"][0], r["resources"][0]) for p in policies for r in p["spec"]["matchConstraints"]["resourceRules"]}
    assert kinds == {("", "pods"), ("batch", "jobs"), ("jobset.x-k8s.io", "jobsets")}


@pytest.mark.parametrize("stack", [*STACKS, *VARIANTS])
def test_every_plan_enforces_the_rules_and_its_own_job_passes_them(all_plans, stack):
    """The four stacks and the fabric variants (EFA on p4d/p5en, GPUDirect-TCPX, -TCPXO and RDMA)."""
    objs = kubernetes_objects(all_plans[stack])
    admission = Admission(objs)
    assert sorted(p["metadata"]["name"] for p in admission.policies) == sorted(
        pod_admission.policy_name(k) for k in pod_admission.SPEC_LISTS)
    team_objects = [o for o in objs if o["kind"] in ("JobSet", "Job", "Pod")
                    and o["metadata"].get("namespace", "").startswith(naming.team_namespace(""))]
    assert team_objects, "the stack's job"
    for obj in team_objects:
        assert admission.denials(obj, obj["metadata"]["namespace"]) == [], obj["metadata"]["name"]
    # The policies name the stack's own registry and NVMe root.
    image = pod_spec_of(team_objects[0])["containers"][0]["image"]
    text = repr([p["spec"] for p in admission.policies])
    assert pod_rules.registry_prefix(pod_rules.repository_of(image)) in text
