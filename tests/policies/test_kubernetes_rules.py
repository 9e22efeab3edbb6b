"""Kubernetes rules on realistic hand-built objects and on the real plans' objects: each passes intact
and fails with one field broken; the exemptions hold exactly for the platform's own host agents.

Usage: `.venv/bin/pytest tests/policies/test_kubernetes_rules.py -q` (no mocks; the exemption tests use
the session `all_plans` fixture: the four stacks and the fabric variants).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from policies import pods
from policies.core import Context, Resource
from policies.kubernetes import allow_all_problems, load_balancer_problems
from policies.rbac import rbac_problems
from policies.registry import RULES
from tests.policies.helpers import broken, details, first, stack_resources

CTX = Context(stack="aws-dev", environment="dev")
DIGEST = "sha256:" + "ab" * 32
IMAGE = f"123456789012.dkr.ecr.us-east-1.amazonaws.com/gpu-train-aws-dev-trainer@{DIGEST}"
RESTRICTED = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
JOBSET_TYPE = "kubernetes:jobset.x-k8s.io/v1alpha2:JobSet"
DAEMONSET_TYPE = "kubernetes:apps/v1:DaemonSet"


def _container(name: str, image: str = IMAGE) -> dict:
    return {"name": name, "image": image, "securityContext": copy.deepcopy(RESTRICTED),
            "resources": {"requests": {"cpu": "8", "memory": "64Gi"}, "limits": {"nvidia.com/gpu": 1}}}


def _pod_spec() -> dict:
    return {"securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "fsGroup": 1000,
                                "seccompProfile": {"type": "RuntimeDefault"}},
            "initContainers": [_container("prefetch")], "containers": [_container("trainer")],
            "volumes": [{"name": "nvme", "hostPath": {"path": "/mnt/k8s-disks/0/gpu-train/team-research",
                                                      "type": "Directory"}}]}


def jobset() -> Resource:
    props = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
             "metadata": {"name": "gpt2-smoke", "namespace": "team-research"},
             "spec": {"replicatedJobs": [{"name": "workers", "replicas": 1,
                                          "template": {"spec": {"template": {"spec": _pod_spec()}}}}]}}
    return Resource(type=JOBSET_TYPE, name="job",
                    urn=f"urn:pulumi:aws-dev::gpu-train::{JOBSET_TYPE}::job", props=props)


def deployment(namespace: str, image: str = "ghcr.io/mlflow/mlflow:v3.17.2@" + DIGEST) -> Resource:
    pod = {"securityContext": {"runAsNonRoot": True}, "containers": [_container("server", image)]}
    props = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "app", "namespace": namespace},
             "spec": {"template": {"spec": pod}}}
    return Resource(type="kubernetes:apps/v1:Deployment", name=f"{namespace}-app",
                    urn=f"urn:pulumi:aws-dev::gpu-train::kubernetes:apps/v1:Deployment::{namespace}-app", props=props)


def _pod(props, i=0):
    return props["spec"]["replicatedJobs"][i]["template"]["spec"]["template"]["spec"]


def _trainer(props):
    return _pod(props)["containers"][0]


JOBSET_CASES = [
    ("training-pod-security", lambda p: _pod(p)["securityContext"].pop("runAsNonRoot"), "runAsNonRoot"),
    ("training-pod-security", lambda p: _trainer(p)["securityContext"].update(runAsNonRoot=False), "runAsNonRoot"),
    ("training-pod-security", lambda p: _trainer(p)["securityContext"].update(runAsUser=0), "runAsUser is 0"),
    ("training-pod-security", lambda p: _pod(p)["initContainers"][0]["securityContext"].pop(
        "allowPrivilegeEscalation"), "allowPrivilegeEscalation"),
    ("training-pod-security", lambda p: _trainer(p)["securityContext"]["capabilities"].update(drop=["NET_RAW"]),
     "drop does not include ALL"),
    ("training-pod-security", lambda p: _pod(p)["securityContext"].pop("seccompProfile"), "seccompProfile"),
    ("training-pod-security", lambda p: _trainer(p)["securityContext"].update(
        seccompProfile={"type": "Unconfined"}), "Unconfined"),
    ("pod-host-isolation", lambda p: _trainer(p)["securityContext"].update(privileged=True), "privileged"),
    ("pod-host-isolation", lambda p: _pod(p).update(hostNetwork=True), "hostNetwork"),
    ("pod-host-isolation", lambda p: _pod(p).update(hostPID=True), "hostPID"),
    ("pod-host-isolation", lambda p: _pod(p).update(hostIPC=True), "hostIPC"),
    ("pod-host-isolation", lambda p: _trainer(p)["securityContext"]["capabilities"].update(add=["SYS_ADMIN"]),
     "SYS_ADMIN"),
    ("pod-host-isolation", lambda p: _trainer(p)["securityContext"]["capabilities"].update(add=["CAP_NET_ADMIN"]),
     "NET_ADMIN"),
    ("pod-host-isolation", lambda p: _trainer(p).update(ports=[{"containerPort": 29500, "hostPort": 29500}]),
     "hostPort"),
    ("pod-host-isolation", lambda p: _pod(p)["volumes"].append({"name": "root", "hostPath": {"path": "/"}}),
     "'/'"),
    ("training-image-digest", lambda p: _trainer(p).update(image="ghcr.io/acme/trainer:latest"), "not pinned"),
    ("container-requests", lambda p: _trainer(p)["resources"].pop("requests"), "cpu, memory"),
    ("container-requests", lambda p: _pod(p)["initContainers"][0]["resources"]["requests"].pop("memory"),
     "memory"),
]


@pytest.mark.parametrize(("rule_id", "mutate", "word"), JOBSET_CASES)
def test_jobset_rules(rule_id, mutate, word):
    intact = jobset()
    for r in RULES:
        if r.scope == "resource":
            assert details(r.id, [intact], CTX) == [], r.id
    found = details(rule_id, [broken(intact, mutate)], CTX)
    assert found and any(word in d for d in found), found


def test_net_bind_service_is_the_one_capability_a_pod_may_add():
    ok = broken(jobset(), lambda p: _trainer(p)["securityContext"]["capabilities"].update(add=["NET_BIND_SERVICE"]))
    assert details("pod-host-isolation", [ok], CTX) == []


def test_team_namespace_workloads_are_training_pods_and_others_are_held_to_non_root():
    team, other = deployment("team-research"), deployment("mlflow")
    root = lambda p: p["spec"]["template"]["spec"]["securityContext"].update(runAsNonRoot=False)  # noqa: E731
    assert details("training-pod-security", [broken(team, root)], CTX)
    assert details("pod-non-root", [broken(team, root)], CTX) == []  # the training rule covers it
    assert details("training-pod-security", [broken(other, root)], CTX) == []
    assert details("pod-non-root", [broken(other, root)], CTX)
    tag = lambda p: p["spec"]["template"]["spec"]["containers"][0].update(image="mlflow:latest")  # noqa: E731
    assert details("training-image-digest", [broken(team, tag)], CTX)
    assert details("image-digest", [broken(team, tag)], CTX) == []  # the mandatory rule covers it
    assert details("training-image-digest", [broken(other, tag)], CTX) == []
    assert details("image-digest", [broken(other, tag)], CTX)
    assert details("image-digest", [other], CTX) == []


# ---- every pod-template kind, in every namespace ---------------------------------------------

def _with_pod(kind: str, api: str, spec_path: tuple[str, ...], namespace: str = "monitoring") -> dict:
    pod = {"securityContext": {"runAsNonRoot": True}, "hostNetwork": True,
           "containers": [_container("c", "registry.example/agent@" + DIGEST)]}
    body: dict = {"apiVersion": api, "kind": kind, "metadata": {"name": "x", "namespace": namespace}}
    node = body
    for step in spec_path[:-1]:
        node = node.setdefault(step, [{}] if step == "replicatedJobs" else {})
        if isinstance(node, list):
            node = node[0]
    node[spec_path[-1]] = pod
    return body


POD_KINDS = [
    ("Pod", "v1", ("spec",)),
    ("PodTemplate", "v1", ("template", "spec")),
    ("Deployment", "apps/v1", ("spec", "template", "spec")),
    ("StatefulSet", "apps/v1", ("spec", "template", "spec")),
    ("DaemonSet", "apps/v1", ("spec", "template", "spec")),
    ("ReplicaSet", "apps/v1", ("spec", "template", "spec")),
    ("ReplicationController", "v1", ("spec", "template", "spec")),
    ("Job", "batch/v1", ("spec", "template", "spec")),
    ("CronJob", "batch/v1", ("spec", "jobTemplate", "spec", "template", "spec")),
    ("JobSet", "jobset.x-k8s.io/v1alpha2", ("spec", "replicatedJobs", "template", "spec", "template", "spec")),
    ("LeaderWorkerSet", "leaderworkerset.x-k8s.io/v1", ("spec", "leaderWorkerTemplate", "workerTemplate", "spec")),
    ("Notebook", "kubeflow.org/v1", ("spec", "template", "spec")),  # any other kind with a pod template
]


@pytest.mark.parametrize(("kind", "api", "path"), POD_KINDS, ids=[k[0] for k in POD_KINDS])
@pytest.mark.parametrize("namespace", ["monitoring", "team-research", "kube-system"])
def test_host_network_is_caught_in_every_pod_template_kind_and_namespace(kind, api, path, namespace):
    obj = _with_pod(kind, api, path, namespace)
    assert any("hostNetwork" in p for p in pods.host_isolation_problems(obj)), obj
    cleared = copy.deepcopy(obj)
    for _, spec in pods.pod_specs(cleared):
        spec.pop("hostNetwork")
    assert pods.host_isolation_problems(cleared) == []


def test_image_repository_normalises_docker_hub_names_and_drops_tags_and_digests():
    assert pods.image_repository("ubuntu:24.04") == "docker.io/library/ubuntu"
    assert pods.image_repository("grafana/grafana:12.0.0") == "docker.io/grafana/grafana"
    assert pods.image_repository("localhost:5000/a/b:1@" + DIGEST) == "localhost:5000/a/b"
    assert pods.image_repository("us-docker.pkg.dev/p/r/img@" + DIGEST) == "us-docker.pkg.dev/p/r/img"


# ---- host paths ------------------------------------------------------------------------------

@pytest.mark.parametrize(("path", "read_only", "allowed"), [
    ("/mnt/k8s-disks/0/gpu-train/team-research", False, True),  # own namespace's work directory
    ("/mnt/stateful_partition/gpu-train/nvme-raid/gpu-train/team-research/", False, True),
    ("/mnt/k8s-disks/0/gpu-train/team-applied", False, False),  # another team's
    ("/mnt/k8s-disks/0/gpu-train/team-research/../team-applied", False, False),
    ("/mnt/k8s-disks/0", False, False),  # the whole NVMe array
    ("/home/kubernetes/bin/nvidia/lib64", True, True),
    ("/home/kubernetes/bin/nvidia/lib64", False, False),  # writable driver directory
    ("/dev/aperture_devices", False, True),
    ("/sys", True, False),  # only the GPUDirect sidecar may
    ("/var/run/docker.sock", False, False),
    ("/", True, False),
])
def test_host_path_allow_list(path, read_only, allowed):
    def mutate(p):
        _pod(p)["volumes"] = [{"name": "host", "hostPath": {"path": path}}]
        _trainer(p)["volumeMounts"] = [{"name": "host", "mountPath": "/host", "readOnly": read_only}]
    found = details("pod-host-isolation", [broken(jobset(), mutate)], CTX)
    assert (found == []) == allowed, found


# ---- exemptions, on the real plans -----------------------------------------------------------

def _daemonsets(all_plans) -> list[tuple[str, Resource]]:
    return [(s, r) for s in all_plans for r in stack_resources(all_plans, s)
            if r.type == DAEMONSET_TYPE and r.props.get("metadata", {}).get("namespace") == "gpu-system"]


def _needs_the_host(obj) -> bool:
    for _, spec in pods.pod_specs(obj):
        if spec.get("hostNetwork") or spec.get("hostPID") or spec.get("hostIPC"):
            return True
        if any((c.get("securityContext") or {}).get("privileged") for _, c in pods.containers(spec)):
            return True
    return False


def test_every_object_of_the_plans_that_needs_the_host_is_a_documented_exemption_and_passes(all_plans):
    seen, sidecars = set(), 0
    for stack in all_plans:
        for res in stack_resources(all_plans, stack):
            obj = pods.k8s_object(res)
            agent = pods.host_agent(obj) if obj is not None else None
            if agent is not None:
                seen.add(agent.name)
            if obj is None or not _needs_the_host(obj):
                continue
            if agent is None:  # only a training pod with a GPUDirect sidecar may hold one otherwise
                assert pods.is_training(obj) and any(
                    pods.grant(obj, c) for _, spec in pods.pod_specs(obj) for _, c in pods.containers(spec)), \
                    f"{stack}: {res.name} needs the host but has no exemption"
                sidecars += 1
            for rule_id in ("pod-host-isolation", "pod-non-root", "training-pod-security"):
                assert details(rule_id, [res], CTX) == [], (stack, res.name, rule_id)
    assert seen == {a.name for a in pods.HOST_AGENTS}, "every HostAgent entry is used by some plan"
    assert sidecars >= 2  # the A3 High (TCPX) and A3 Mega (TCPXO) JobSets


def test_host_agent_grants_are_no_wider_than_what_the_agents_use(all_plans):
    """Every granted host namespace, host path, capability and privilege is used by the agent it is for."""
    used: dict[str, set] = {a.name: set() for a in pods.HOST_AGENTS}
    for _, res in _daemonsets(all_plans):
        agent = pods.host_agent(res.props)
        for _, spec in pods.pod_specs(res.props):
            used[agent.name] |= {f for f in ("hostNetwork", "hostPID") if spec.get(f)}
            used[agent.name] |= {("path", v["hostPath"]["path"]) for v in spec.get("volumes", []) if "hostPath" in v}
            for _, c in pods.containers(spec):
                sc = c.get("securityContext") or {}
                used[agent.name] |= {(c["name"], "cap", cap) for cap in sc.get("capabilities", {}).get("add", [])}
                if sc.get("privileged"):
                    used[agent.name].add((c["name"], "privileged"))
                if sc.get("runAsUser") == 0:
                    used[agent.name].add((c["name"], "root"))
    for agent in pods.HOST_AGENTS:
        granted = {f for f, on in (("hostNetwork", agent.host_network), ("hostPID", agent.host_pid)) if on}
        granted |= {("path", p) for p in agent.host_paths}
        for cname, g in agent.containers.items():
            granted |= {(cname, "cap", cap) for cap in g.capabilities}
            granted |= {(cname, "privileged")} if g.privileged else set()
            granted |= {(cname, "root")} if g.root else set()
        assert granted <= used[agent.name], (agent.name, granted - used[agent.name])


def _agent(all_plans, name: str) -> Resource:
    found = [r for _, r in _daemonsets(all_plans) if r.props["metadata"]["name"] == name]
    assert found, f"no {name} DaemonSet in the plans"
    return found[0]


def _ds_pod(props):
    return props["spec"]["template"]["spec"]


def _init(props, name):
    return next(c for c in _ds_pod(props)["initContainers"] if c["name"] == name)


@pytest.mark.parametrize(("agent", "mutate", "rule_id", "word"), [
    # The same object under another name or in another namespace is no longer the agent.
    ("nvme-raid0", lambda p: p["metadata"].update(name="disk-tool"), "pod-host-isolation", "privileged"),
    ("nvme-raid0", lambda p: p["metadata"].update(namespace="monitoring"), "pod-host-isolation", "hostPID"),
    ("nvme-workdirs", lambda p: p["metadata"].update(namespace="team-research"), "pod-host-isolation",
     "/mnt/k8s-disks/0"),
    # A granted container running another image loses its grant.
    ("nvme-raid0", lambda p: _init(p, "raid0").update(image="ghcr.io/acme/raid:1"), "pod-host-isolation",
     "privileged"),
    ("nvme-workdirs", lambda p: _init(p, "workdirs").update(image="busybox:1.37"), "pod-non-root", "runAsUser is 0"),
    # A grant covers what it lists and nothing more.
    ("nvme-workdirs", lambda p: _init(p, "workdirs")["securityContext"]["capabilities"].update(
        add=["CHOWN", "FOWNER", "SYS_ADMIN"]), "pod-host-isolation", "SYS_ADMIN"),
    ("nvme-workdirs", lambda p: _ds_pod(p).update(hostNetwork=True), "pod-host-isolation", "hostNetwork"),
    ("nvme-workdirs", lambda p: _ds_pod(p)["volumes"].append({"name": "etc", "hostPath": {"path": "/etc"}}),
     "pod-host-isolation", "/etc"),
    ("nvme-workdirs", lambda p: _ds_pod(p)["containers"][0]["securityContext"].update(privileged=True),
     "pod-host-isolation", "privileged"),
])
def test_host_agent_exemption_needs_kind_namespace_name_and_image(all_plans, agent, mutate, rule_id, word):
    real = _agent(all_plans, agent)
    assert details(rule_id, [real], CTX) == []
    found = details(rule_id, [broken(real, mutate)], CTX)
    assert found and any(word in d for d in found), found


# ---- the GPUDirect receive-datapath sidecars ---------------------------------------------------

GPROD = Context(stack="gcp-prod", environment="prod")
RXDM_RULES = ("training-pod-security", "pod-host-isolation", "training-image-digest", "container-requests")


def _rxdm(props):
    """The tcpxo-daemon sidecar of a real gcp-prod JobSet's pod."""
    return next(c for c in _pod(props)["initContainers"] if c["name"] == "tcpxo-daemon")


def test_real_gcp_prod_jobset_with_its_privileged_gpudirect_sidecar_passes(plans):
    real = first(plans, "gcp-prod", JOBSET_TYPE)
    sidecar = _rxdm(real.props)
    assert sidecar["securityContext"]["privileged"] is True  # the case the exemption is for
    assert not sidecar["image"].count("@sha256:")
    for rule_id in RXDM_RULES:
        assert details(rule_id, [real], GPROD) == [], rule_id


@pytest.mark.parametrize(("mutate", "rules"), [
    # Same privileged root container under another name: every check applies again.
    (lambda c: c.update(name="helper"), {"training-pod-security", "pod-host-isolation", "training-image-digest"}),
    # Same name, another image (or a look-alike repository): not Google's manager.
    (lambda c: c.update(image="ghcr.io/acme/tcpgpudmarxd-dev:v1.0.18"),
     {"training-pod-security", "pod-host-isolation", "training-image-digest"}),
    (lambda c: c.update(image="us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo-evil/tcpgpudmarxd-dev:v1"),
     {"training-pod-security", "pod-host-isolation", "training-image-digest"}),
    (lambda c: c.update(image="us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/tcpgpudmarxd-dev:v2.0.12"),
     {"training-pod-security", "pod-host-isolation", "training-image-digest"}),  # TCPX's manager, TCPXO's name
    # The exemption never covers resource requests.
    (lambda c: c.pop("resources"), {"container-requests"}),
])
def test_gpudirect_exemption_needs_both_the_name_and_googles_repository(plans, mutate, rules):
    real = first(plans, "gcp-prod", JOBSET_TYPE)
    bad = broken(real, lambda p: mutate(_rxdm(p)))
    for rule_id in RXDM_RULES:
        found = details(rule_id, [bad], GPROD)
        assert bool(found) == (rule_id in rules), (rule_id, found)
    if "pod-host-isolation" in rules:
        assert "privileged" in " ".join(details("pod-host-isolation", [bad], GPROD))
        assert "allowPrivilegeEscalation" in " ".join(details("training-pod-security", [bad], GPROD))


def test_the_sidecar_host_paths_are_the_sidecars_alone(plans):
    real = first(plans, "gcp-prod", JOBSET_TYPE)

    def trainer_mounts_sys(p):
        trainer = next(c for c in _pod(p)["containers"] if c["name"] == "trainer")
        trainer["volumeMounts"].append({"name": "sys", "mountPath": "/host-sys"})
    found = details("pod-host-isolation", [broken(real, trainer_mounts_sys)], GPROD)
    assert found and "/sys" in found[0] and "trainer" in found[0], found


# ---- RBAC ------------------------------------------------------------------------------------

def _role(rules: list[dict], kind: str = "Role") -> dict:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": kind,
            "metadata": {"name": "r", "namespace": "team-research"}, "rules": rules}


def _binding(role_kind: str, role: str, subjects: list[dict], kind: str = "RoleBinding") -> dict:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": kind,
            "metadata": {"name": "b", "namespace": "team-research"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind, "name": role},
            "subjects": subjects}


TEAM = [{"apiGroup": "rbac.authorization.k8s.io", "kind": "Group", "name": "ml-research@acme.example"}]
SUBMIT = {"apiGroups": ["jobset.x-k8s.io"], "resources": ["jobsets"], "verbs": ["create", "get", "list"]}


@pytest.mark.parametrize(("obj", "word"), [
    (_binding("ClusterRole", "cluster-admin", TEAM), "cluster-admin"),
    (_binding("ClusterRole", "cluster-admin", TEAM, kind="ClusterRoleBinding"), "every namespace"),
    (_binding("Role", "job-submitter", [{"kind": "Group", "name": "system:masters"}]), "system:masters"),
    (_binding("Role", "job-submitter", [{"kind": "Group", "name": "system:unauthenticated"}]), "unauthenticated"),
    (_role([SUBMIT, {"apiGroups": ["*"], "resources": ["jobsets"], "verbs": ["get"]}]), "rules[1].apiGroups"),
    (_role([{**SUBMIT, "resources": ["*"]}]), "resources"),
    (_role([{**SUBMIT, "verbs": ["*"]}]), "verbs"),
    (_role([SUBMIT, {"apiGroups": [""], "resources": ["users", "groups"], "verbs": ["impersonate"]}]), "impersonate"),
    (_role([{"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["roles"], "verbs": ["escalate"]}],
           kind="ClusterRole"), "escalate"),
    (_role([{"apiGroups": ["rbac.authorization.k8s.io"], "resources": ["rolebindings"], "verbs": ["bind"]}]), "bind"),
])
def test_rbac_problems(obj, word):
    found = rbac_problems(obj)
    assert found and any(word in f for f in found), found


def test_rbac_least_privilege_objects_pass():
    assert rbac_problems(_role([SUBMIT])) == []
    assert rbac_problems(_binding("Role", "job-submitter", TEAM)) == []
    assert rbac_problems(_binding("ClusterRole", "view", TEAM)) == []


def test_real_team_roles_and_bindings_pass_and_fail_once_widened(plans):
    for stack in plans:
        for res in stack_resources(plans, stack):
            if res.type.startswith("kubernetes:rbac.authorization.k8s.io/"):
                assert details("rbac-least-privilege", [res], CTX) == [], res.name
    binding = first(plans, "aws-prod", "kubernetes:rbac.authorization.k8s.io/v1:RoleBinding")
    admin = broken(binding, lambda p: p["roleRef"].update(kind="ClusterRole", name="cluster-admin"))
    assert any("cluster-admin" in d for d in details("rbac-least-privilege", [admin], CTX))


# ---- NetworkPolicies -------------------------------------------------------------------------

def _netpol(**spec) -> dict:
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "p", "namespace": "team-research"}, "spec": {"podSelector": {}, **spec}}


@pytest.mark.parametrize(("policy", "problem"), [
    (_netpol(policyTypes=["Ingress"], ingress=[{}]), True),
    (_netpol(policyTypes=["Egress"], egress=[{}]), True),
    (_netpol(policyTypes=["Ingress"], ingress=[{"from": [{"ipBlock": {"cidr": "0.0.0.0/1"}},
                                                         {"ipBlock": {"cidr": "128.0.0.0/1"}}]}]), True),
    (_netpol(policyTypes=["Ingress"], ingress=[{"from": [{"namespaceSelector": {}}]}]), True),
    (_netpol(policyTypes=["Egress"], egress=[{"to": [{"ipBlock": {"cidr": "::/0"}}]}]), True),
    # Restricted by ports, or by peers: not allow-all.
    (_netpol(policyTypes=["Egress"], egress=[{"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}],
                                              "ports": [{"port": 443, "protocol": "TCP"}]}]), False),
    (_netpol(policyTypes=["Egress"], egress=[{"ports": [{"port": 53, "protocol": "UDP"}]}]), False),
    (_netpol(policyTypes=["Ingress"], ingress=[{"from": [{"ipBlock": {"cidr": "0.0.0.0/0",
                                                                      "except": ["8.8.8.0/24"]}}]}]), False),
    (_netpol(policyTypes=["Ingress"], ingress=[{"from": [{"podSelector": {}}]}]), False),
    (_netpol(policyTypes=["Ingress"], ingress=[{"from": [{"namespaceSelector": {
        "matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]}]), False),
])
def test_allow_all_network_policies(policy, problem):
    assert bool(allow_all_problems(policy)) == problem


def _namespace(name: str) -> Resource:
    return Resource(type="kubernetes:core/v1:Namespace", name=name,
                    urn=f"urn:pulumi:aws-dev::gpu-train::kubernetes:core/v1:Namespace::{name}",
                    props={"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})


def _deny(namespace: str, **spec) -> Resource:
    body = {"podSelector": {}, "policyTypes": ["Ingress", "Egress"], **spec}
    return Resource(type="kubernetes:networking.k8s.io/v1:NetworkPolicy", name=f"{namespace}-default-deny",
                    urn=f"urn:pulumi:aws-dev::gpu-train::kubernetes:networking.k8s.io/v1:NetworkPolicy::{namespace}",
                    props={"metadata": {"name": "default-deny", "namespace": namespace}, "spec": body})


@pytest.mark.parametrize(("policy", "why"), [
    (None, "no policy"),
    (_deny("team-research", policyTypes=["Ingress"]), "ingress only"),
    (_deny("team-research", podSelector={"matchLabels": {"app": "x"}}), "selects some pods"),
    (_deny("team-research", ingress=[{"from": [{"podSelector": {}}]}]), "allows traffic"),
    (_deny("mlflow"), "other namespace"),
])
def test_namespace_default_deny_fails(policy, why):
    resources = [_namespace("team-research")] + ([policy] if policy else [])
    found = details("namespace-default-deny", resources, CTX)
    assert len(found) == 1 and "team-research" in found[0], why


def test_namespace_default_deny_passes():
    resources = [_namespace("team-research"), _deny("team-research"), _namespace("mlflow"), _deny("mlflow")]
    assert details("namespace-default-deny", resources, CTX) == []


# ---- load balancers --------------------------------------------------------------------------

def _service(type_: str = "LoadBalancer", **annotations: str) -> dict:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": "s", "namespace": "mlflow", "annotations": annotations},
            "spec": {"type": type_, "ports": [{"port": 5000}]}}


@pytest.mark.parametrize(("obj", "cloud", "public"), [
    (_service(), "aws", True),
    (_service(**{"service.beta.kubernetes.io/aws-load-balancer-scheme": "internet-facing"}), "aws", True),
    (_service(**{"service.beta.kubernetes.io/aws-load-balancer-scheme": "internal"}), "aws", False),
    (_service(**{"service.beta.kubernetes.io/aws-load-balancer-internal": "true"}), "aws", False),
    (_service(**{"networking.gke.io/load-balancer-type": "Internal"}), "gcp", False),
    (_service(**{"networking.gke.io/load-balancer-type": "Internal"}), "aws", True),  # the other cloud's
    (_service(**{"service.beta.kubernetes.io/aws-load-balancer-scheme": "internal"}), "gcp", True),
    (_service("ClusterIP"), "aws", False),
    ({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": {"name": "i"}, "spec": {}}, "gcp", True),
    ({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": {"name": "i"},
      "spec": {"ingressClassName": "gce-internal"}}, "gcp", False),
    ({"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
      "metadata": {"name": "i", "annotations": {"alb.ingress.kubernetes.io/scheme": "internet-facing"}},
      "spec": {"ingressClassName": "alb"}}, "aws", True),
])
def test_load_balancer_exposure(obj, cloud, public):
    assert bool(load_balancer_problems(obj, cloud)) == public


def test_real_services_are_internal_and_fail_as_public_load_balancers(plans):
    for stack in plans:
        resources = stack_resources(plans, stack)
        assert details("no-public-load-balancer", resources, CTX) == []
        svc = next(r for r in resources if r.type == "kubernetes:core/v1:Service")
        public = broken(svc, lambda p: p["spec"].update(type="LoadBalancer"))
        found = details("no-public-load-balancer", [public if r.urn == svc.urn else r for r in resources], CTX)
        assert found and "LoadBalancer" in found[0], (stack, found)


# ---- storage classes, docs -------------------------------------------------------------------

def test_storage_class_encryption():
    sc = Resource(type="kubernetes:storage.k8s.io/v1:StorageClass", name="encrypted-gp3", urn="urn:sc",
                  props={"provisioner": "ebs.csi.aws.com",
                         "parameters": {"type": "gp3", "encrypted": "true", "kmsKeyId": "arn:aws:kms:k"}})
    assert details("disk-encryption-cmk", [sc], CTX) == []
    bad = copy.deepcopy(dict(sc.props))
    del bad["parameters"]["kmsKeyId"]
    assert details("disk-encryption-cmk", [broken(sc, lambda p: p.update(bad))], CTX)


def test_every_rule_is_listed_in_the_docs_with_its_level_benchmarks_and_exemptions():
    text = (Path(__file__).resolve().parents[2] / "docs" / "policies.md").read_text()
    rows = {line.split("|")[1].strip(" `"): line for line in text.splitlines() if line.startswith("| `")}
    for r in RULES:
        assert r.id in rows, f"{r.id} has no row in docs/policies.md"
        row = rows[r.id]
        assert f"| `{r.id}` | {r.level} |" in row, r.id
        missing = [b for b in r.benchmarks if b.removeprefix("checkov ").removeprefix("PSS ") not in row]
        assert not missing, (r.id, missing)
        if r.exemptions != "none":
            assert "exempt" in row.lower(), r.id
