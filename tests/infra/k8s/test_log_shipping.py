"""The log shipper (infra/k8s/log_shipping.py): Fluent Bit's values against the aws-for-fluent-bit chart at the
pinned version, which container log files it reads and where each goes, its NetworkPolicies, and the plans: EKS
stacks ship team logs to CloudWatch, GKE stacks leave them to Cloud Logging.

Run: .venv/bin/pytest tests/infra/k8s/test_log_shipping.py -q
"""

from __future__ import annotations

import fnmatch

import pytest

from gpu_train.spec import naming
from infra.k8s import log_shipping as ls
from infra.plan import kubernetes_objects
from infra.platform import EgressTarget, LogStore, WorkloadIdentity
from tests.conftest import STACKS, resources_of
from tools.validation import helm

STORE = LogStore(kind="cloudwatch", region="us-east-1",
                 groups={"team-research": "/gpu-train/c/team-research", "team-applied": "/gpu-train/c/team-applied"},
                 shipper=WorkloadIdentity(namespaces=["logging"], name="fluent-bit"), endpoint_cidrs=["10.0.0.0/16"])
FILES = {  # kubelet's /var/log/containers/<pod>_<namespace>_<container>-<container id>.log
    "research": "/var/log/containers/llm-worker-0-0-abcde_team-research_trainer-0123abcd.log",
    "applied": "/var/log/containers/eval-worker-0-3-fghij_team-applied_trainer-4567ef01.log",
    "system": "/var/log/containers/coredns-5d78c9869d-x2x2x_kube-system_coredns-89abcdef.log",
    "lookalike": "/var/log/containers/team-research-debug_default_shell-0a0b0c0d.log",
}


def _tag(path: str) -> str:
    """Fluent Bit's tail input tag for a file: the `kube.*` tag with the path's slashes as dots."""
    return ls.TAIL_TAG_PREFIX + path.lstrip("/").replace("/", ".")


def _outputs(conf: str) -> list[dict[str, str]]:
    blocks = [b for b in conf.split("[OUTPUT]") if b.strip()]
    return [dict(line.split(None, 1) for line in b.strip().splitlines()) for b in blocks]


def test_the_values_are_the_charts_keys_and_types():
    result = helm.check_release(helm.Release(name=ls.RELEASE, chart=ls.CHART, version=ls.CHART_VERSION,
                                             repo=ls.CHART_REPO, values=ls.fluent_bit_values(STORE)))
    assert result.problems == [] and result.unverified == []


def test_a_misspelled_value_is_caught():
    values = ls.fluent_bit_values(STORE)
    values["cloudWatchLogs"]["enable"] = False
    result = helm.check_release(helm.Release(name=ls.RELEASE, chart=ls.CHART, version=ls.CHART_VERSION,
                                             repo=ls.CHART_REPO, values=values))
    assert any("cloudWatchLogs.enable" in p for p in result.problems)


def test_only_team_namespaces_files_are_read_and_each_goes_to_its_teams_group():
    values = ls.fluent_bit_values(STORE)
    path_glob = values["input"]["path"]
    read = {k for k, f in FILES.items() if fnmatch.fnmatchcase(f, path_glob)}
    assert read == {"research", "applied"}
    outputs = _outputs(values["additionalOutputs"])
    assert {o["log_group_name"] for o in outputs} == set(STORE.groups.values())
    for key in ("research", "applied"):
        tag = _tag(FILES[key])
        (dest,) = [o for o in outputs if fnmatch.fnmatchcase(tag, o["Match"])]
        assert dest["log_group_name"] == STORE.groups[naming.team_namespace(key)]
        assert (dest["Name"], dest["auto_create_group"], dest["log_key"]) == ("cloudwatch_logs", "false", "log")
        assert dest["region"] == "us-east-1"
    # The chart's own outputs stay off; no Kubernetes filter (the shipper never calls the API server).
    assert values["cloudWatchLogs"] == {"enabled": False} and values["filter"] == {"enabled": False}


def test_a_ranks_stream_prefix_finds_its_pods_streams_only():
    outputs = _outputs(ls.outputs_config(STORE))
    prefix = outputs[0]["log_stream_prefix"]
    stream = prefix + _tag("/var/log/containers/llm-worker-0-1-abcde_team-research_trainer-0123abcd.log")
    assert stream.startswith(naming.rank_stream_prefix("llm", 1))
    other = prefix + _tag("/var/log/containers/llm-worker-0-12-abcde_team-research_trainer-0123abcd.log")
    assert not other.startswith(naming.rank_stream_prefix("llm", 1))


def test_outputs_need_cloudwatch_and_resolved_groups():
    with pytest.raises(ValueError, match="no team namespace"):
        ls.outputs_config(LogStore(kind="cloudwatch", region="r", groups={}, shipper=STORE.shipper,
                                   endpoint_cidrs=[]))


def test_network_policies_let_the_shipper_reach_only_the_store_and_its_credentials():
    policies = dict(ls.network_policies(STORE, _plain_platform()))
    assert list(policies)[0] == "default-deny-all"
    egress = policies["allow-log-store"]["egress"]
    assert egress[0] == {"to": [{"ipBlock": {"cidr": "10.0.0.0/16"}}], "ports": [{"protocol": "TCP", "port": 443}]}
    assert egress[1] == {"to": [{"ipBlock": {"cidr": "169.254.170.23/32"}}], "ports": [{"protocol": "TCP", "port": 80}]}
    assert not any("ingress" in spec for spec in policies.values())


def _plain_platform():
    """The one field network_policies reads besides the store: where pods get cloud credentials (EKS Pod Identity)."""
    from types import SimpleNamespace

    return SimpleNamespace(workload_identity_egress=[EgressTarget("169.254.170.23/32", 80)])


@pytest.mark.parametrize("stack", STACKS)
def test_eks_stacks_ship_team_logs_and_gke_stacks_leave_them_to_cloud_logging(plans, stack):
    plan = plans[stack]
    releases = [r["inputs"] for r in resources_of(plan, "kubernetes:helm.sh/v3:Release")
                if r["inputs"]["chart"] == ls.CHART]
    namespaces = {o["metadata"]["name"]: o for o in kubernetes_objects(plan) if o["kind"] == "Namespace"}
    if stack.startswith("gcp"):
        assert releases == [] and "logging" not in namespaces
        assert plan["outputs"]["platform"]["logs"]["kind"] == "cloud-logging"
        return
    (release,) = releases
    assert (release["version"], release["repositoryOpts"]["repo"]) == (ls.CHART_VERSION, ls.CHART_REPO)
    ns = namespaces[release["namespace"]]
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    groups = plan["outputs"]["platform"]["logs"]["groups"]
    assert {o["log_group_name"] for o in _outputs(release["values"]["additionalOutputs"])} == set(groups.values())
    netpols = [o["metadata"]["name"] for o in kubernetes_objects(plan) if o["kind"] == "NetworkPolicy"
               and o["metadata"]["namespace"] == release["namespace"]]
    assert sorted(netpols) == ["allow-dns", "allow-log-store", "default-deny-all"]
