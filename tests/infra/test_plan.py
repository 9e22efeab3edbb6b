"""The offline plan tool: every stack plans, the document has the promised shape, secrets never leak,
every planned job is one Kueue admits and whose pods fit their nodes, and a table of broken stack
files each exits with status 2 and the culprit's key, never a traceback.

Usage: .venv/bin/pytest tests/infra/test_plan.py -q   (plans every stack and ~60 broken files: minutes)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from gpu_train.jobs import fit
from gpu_train.spec import catalog
from gpu_train.spec.contract import PlatformContract
from gpu_train.spec.errors import SettingsError
from infra import plan as plan_tool
from infra.platform import CLOUD_AGENTS_CPU, CLOUD_AGENTS_MEMORY, GPU_NODE_AGENTS_CPU, GPU_NODE_AGENTS_MEMORY
from tests.conftest import ROOT, STACKS, resources_of
from tests.gpu_train.spec.test_yamlfile import twice

# Runs the Pulumi program (python -m infra.plan) on every stack and on broken copies.
pytestmark = pytest.mark.integration


def run_plan(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infra.plan", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=300)


def test_all_four_stacks_exist():
    assert set(STACKS) >= {"aws-dev", "aws-prod", "gcp-dev", "gcp-prod"}


def test_a_stack_file_with_a_key_twice_is_refused_naming_it_and_both_lines(tmp_path):
    text, first, second = twice((ROOT / "stacks" / "Pulumi.aws-dev.yaml").read_text(), "maxNodes", "40")
    path = tmp_path / "Pulumi.x.yaml"
    path.write_text(text)
    with pytest.raises(SettingsError) as err:
        plan_tool.read_stack_file(path)
    assert err.value.problems == [f"{path}: not valid YAML: key 'maxNodes' is given twice in one mapping, on lines "
                                  f"{first} and {second} (keep one)"]


def test_plan_document_shape(plans):
    for stack, doc in plans.items():
        assert doc["project"] == "gpu-train" and doc["stack"] == stack
        assert len(doc["resources"]) > 50, f"{stack} planned only {len(doc['resources'])} resources"
        urns = {r["urn"] for r in doc["resources"]}
        for res in doc["resources"]:
            assert set(res) == {"urn", "type", "name", "parent", "inputs"}
            assert res["type"].count(":") >= 2, res["type"]
            # Every parent is the stack or another planned resource.
            assert res["parent"] is None or res["parent"] in urns or res["parent"].endswith(
                f"pulumi:pulumi:Stack::gpu-train-{stack}"), res["parent"]


def test_each_stack_only_uses_its_own_cloud(plans):
    for stack, doc in plans.items():
        cloud = stack.split("-")[0]
        other = "gcp" if cloud == "aws" else "aws"
        types = {r["type"] for r in doc["resources"]}
        assert any(t.startswith(f"{cloud}:") for t in types)
        assert not any(t.startswith(f"{other}:") for t in types), stack


def test_secrets_are_redacted(plans, plan_dir):
    for stack, doc in plans.items():
        assert doc["outputs"]["kubeconfig"] == plan_tool.SECRET
        text = (plan_dir / f"{stack}.json").read_text()
        assert plan_tool._SECRET_SIG not in text
        assert "ya29.mock-token" not in text, "a registry access token leaked into the plan"


def test_bucket_outputs_use_the_clouds_scheme(plans):
    for stack, doc in plans.items():
        scheme = "s3://" if stack.startswith("aws") else "gs://"
        for key in ("datasetsBucket", "checkpointsBucket", "artifactsBucket"):
            assert str(doc["outputs"][key]).startswith(scheme), (stack, key, doc["outputs"][key])


def test_kubernetes_objects_written_as_yaml(plans, plan_dir):
    for stack, doc in plans.items():
        objects = plan_tool.kubernetes_objects(doc)
        files = sorted((plan_dir / stack / "k8s").glob("*.yaml"))
        assert len(files) == len(objects) > 0, stack
        for f in files:
            obj = yaml.safe_load(f.read_text())
            assert obj["apiVersion"] and obj["kind"] and obj["metadata"]["name"], f


def test_redact_replaces_nested_engine_secrets():
    secret = {plan_tool._SIG_KEY: plan_tool._SECRET_SIG, "value": "hunter2"}
    mapping = {plan_tool._SIG_KEY: plan_tool._SECRET_SIG, "value": {"password": "hunter2", "user": ["a"]}}
    doc = {"a": [1, {"b": secret}], "c": secret, "stringData": mapping}
    assert plan_tool.redact(doc) == {"a": [1, {"b": "[secret]"}], "c": "[secret]",
                                     "stringData": {"password": "[secret]", "user": ["[secret]"]}}
    assert "hunter2" not in json.dumps(plan_tool.redact(doc))


def test_stack_file_option_checks_an_uncommitted_file(tmp_path):
    raw = yaml.safe_load((ROOT / "stacks" / "Pulumi.aws-dev.yaml").read_text())
    raw["config"]["gpu-train:gpuPools"][0]["maxNodes"] = 0
    bad = tmp_path / "Pulumi.my-test.yaml"
    bad.write_text(yaml.safe_dump(raw))
    proc = run_plan("--stack-file", str(bad), "--out", str(tmp_path / "out"))
    assert proc.returncode == 2
    assert "gpu-train:gpuPools[0].maxNodes must be >= 1 (got 0)" in proc.stderr
    assert not (tmp_path / "out").exists(), "a failed plan must not write anything"


def test_stack_file_must_be_named_like_a_stack(tmp_path):
    other = tmp_path / "settings.yaml"
    other.write_text("config: {}\n")
    proc = run_plan("--stack-file", str(other))
    assert proc.returncode == 2 and "must be named Pulumi.<stack>.yaml" in proc.stderr


def test_unknown_stack_is_a_clear_error():
    proc = run_plan("--stack", "does-not-exist")
    assert proc.returncode == 2 and "no such stack settings file" in proc.stderr


@pytest.mark.parametrize("stack", ["aws-dev"])
def test_summary_prints_types_and_outputs(stack, tmp_path):
    proc = run_plan("--stack", stack, "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    assert f"Plan for stack {stack}:" in proc.stdout
    assert "aws:eks/cluster:Cluster" in proc.stdout
    assert "kubeconfig: [secret]" in proc.stdout
    doc = json.loads((tmp_path / f"{stack}.json").read_text())
    assert doc["stack"] == stack


# --------------------------------------------------------------------------- the job against Kueue


def _objects(plan: dict, kind: str) -> list[dict]:
    return [o for o in plan_tool.kubernetes_objects(plan) if o["kind"] == kind]


def _kueue_configuration(plan: dict) -> dict:
    release = next(r["inputs"] for r in resources_of(plan, "kubernetes:helm.sh/v3:Release")
                   if r["inputs"].get("name") == "kueue")
    return yaml.safe_load(release["values"]["managerConfig"]["controllerManagerConfigYaml"])


def _stack_settings(name: str):
    from gpu_train.spec.settings_checks import parse
    from tests.conftest import VARIANTS
    from tools.variants import SERVING, SERVING_BLOCK

    base, instance_type = VARIANTS.get(name, (SERVING.get(name, name), None))
    raw = yaml.safe_load((ROOT / "stacks" / f"Pulumi.{base}.yaml").read_text())["config"]
    if name in SERVING:  # a dev stack with serving enabled (tools/variants.py)
        raw.update(yaml.safe_load(SERVING_BLOCK.read_text()))
    if instance_type:
        for pool in raw["gpu-train:gpuPools"]:
            pool["instanceType"] = instance_type
    return parse(raw, name)


def _flavor_fits(flavor: dict, pod: dict) -> bool:
    """Kueue's flavor assignment for a pod with a node selector: every node label the flavor sets that the pod
    selects on has the selected value (the flavor's own label keys only: pkg/scheduler/flavorassigner at v0.19.2),
    and the pod (with the flavor's tolerations) tolerates the flavor's node taints."""
    selector = pod.get("nodeSelector") or {}
    labels = flavor["spec"].get("nodeLabels") or {}
    if any(k in selector and selector[k] != v for k, v in labels.items()):
        return False
    tolerated = {(t.get("key"), t.get("effect")) for t in [*(pod.get("tolerations") or []),
                                                           *(flavor["spec"].get("tolerations") or [])]}
    return all((t["key"], t["effect"]) in tolerated for t in flavor["spec"].get("nodeTaints") or [])


def _admission_problems(plan: dict, jobset: dict) -> tuple[str, str, list[str]]:
    """(ClusterQueue, flavor, why Kueue would never admit the JobSet whole), from the objects `pulumi up` would
    create: the JobSet's LocalQueue, the ClusterQueues, ResourceFlavors, the namespace's labels and LimitRange, and
    Kueue's configuration."""
    ns = jobset["metadata"]["namespace"]
    queue = jobset["metadata"]["labels"]["kueue.x-k8s.io/queue-name"]
    (lq,) = [o for o in _objects(plan, "LocalQueue") if (o["metadata"]["namespace"], o["metadata"]["name"]) == (ns, queue)]
    queues = _objects(plan, "ClusterQueue")
    (cq,) = [q for q in queues if q["metadata"]["name"] == lq["spec"]["clusterQueue"]]
    (namespace,) = [o for o in _objects(plan, "Namespace") if o["metadata"]["name"] == ns]
    (limits,) = [o["spec"] for o in _objects(plan, "LimitRange") if o["metadata"]["namespace"] == ns]
    pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    offered = [f["name"] for g in cq["spec"]["resourceGroups"] for f in g["flavors"]]
    flavors = {f["metadata"]["name"]: f for f in _objects(plan, "ResourceFlavor")}
    # Kueue takes the first of the queue's flavors the pod set fits, passing over one that could never hold a resource
    # it asks for (the `cpu` flavor has no GPU quota).
    covered = {r for g in cq["spec"]["resourceGroups"] for r in g["coveredResources"]}
    asked = [r for r, n in fit.pod_requests(pod).items() if n > 0 and r in covered]
    (flavor, *_) = [name for name in offered if _flavor_fits(flavors[name], pod) and
                    all(fit.potential_capacity(cq, queues, name, r) > 0 for r in asked)]
    problems = fit.queue_problems(jobset, cluster_queue=cq, cluster_queues=queues, flavor=flavor,
                                  namespace_labels=namespace["metadata"]["labels"], limit_range=limits,
                                  excluded_prefixes=_kueue_configuration(plan)["resources"]["excludeResourcePrefixes"])
    return cq["metadata"]["name"], flavor, problems


def test_every_planned_job_is_admitted_whole_by_its_cluster_queue_and_fits_its_nodes(all_plans):
    """Read back from the plan (the objects `pulumi up` would create, and the contract it publishes)."""
    checked = []
    for stack, plan in all_plans.items():
        (jobset,) = _objects(plan, "JobSet")
        cfg = _stack_settings(stack)
        cluster_queue, flavor, problems = _admission_problems(plan, jobset)
        assert problems == [], (stack, problems)
        assert cluster_queue == f"team-{cfg.job.team}"
        # Every GPU of all MAX pods, on the job's pool.
        assert flavor == cfg.job.pool, stack
        pool = cfg.pool(cfg.job.pool)
        per_node = catalog.shape(cfg.cloud, pool.instance_type).gpus
        ((_, count, pod),) = fit.pod_sets(jobset)
        assert count == cfg.job.nodes.max
        assert count * fit.pod_requests(pod)["nvidia.com/gpu"] == cfg.job.nodes.max * (cfg.job.gpus_per_node or per_node)
        # MAX nodes exist in the pool, and one pod fits one of them, as the platform contract describes its nodes.
        assert cfg.job.nodes.max <= pool.max_nodes
        limits = next(o["spec"] for o in _objects(plan, "LimitRange")
                      if o["metadata"]["namespace"] == jobset["metadata"]["namespace"])
        node = PlatformContract.from_document(plan["outputs"]["platform"], stack).pool(cfg.job.pool).allocatable
        assert fit.node_problems(pod, node.document(), gpus=per_node, limit_range=limits) == [], stack
        checked.append(stack)
    assert {"aws-prod", "gcp-prod", "aws-prod-p5en", "gcp-prod-a3ultra"} <= set(checked)


def _system_node_labels(plan: dict) -> dict[str, str]:
    """The labels the cloud puts on the system nodes: the EKS system node group's, or the GKE system pool's."""
    groups = [r["inputs"]["labels"] for r in resources_of(plan, "aws:eks/nodeGroup:NodeGroup")
              if r["name"].endswith("-system")]
    pools = [r["inputs"]["nodeConfig"]["labels"] for r in resources_of(plan, "gcp:container/nodePool:NodePool")
             if r["name"].endswith("-system")]
    (labels,) = groups + pools
    return labels


def test_data_preparation_is_admitted_on_the_system_nodes_cpu_flavor_with_the_teams_prepare_quota(all_plans):
    """Read back from each plan: the `cpu` ResourceFlavor selects the nodes the cloud labels as system nodes, every
    team's ClusterQueue offers it with the team's prepareQuota setting and no GPU, and a RayJob pod set (what
    `gpu-train prepare --cluster` makes from the published contract) fits it and no GPU pool's flavor."""
    from gpu_train.jobs.prepare import PrepareRequest, ray_job

    for stack, plan in all_plans.items():
        cfg = _stack_settings(stack)
        flavors = {f["metadata"]["name"]: f for f in _objects(plan, "ResourceFlavor")}
        assert set(flavors) == {"cpu", *(p.name for p in cfg.gpu_pools)}, stack
        system = _system_node_labels(plan)
        assert flavors["cpu"]["spec"]["nodeLabels"].items() <= system.items(), stack
        assert not flavors["cpu"]["spec"].get("tolerations"), stack
        contract = PlatformContract.from_document(plan["outputs"]["platform"], stack)
        assert {f["metadata"]["name"]: f["spec"] for f in contract.kueue.resource_flavors} == \
            {n: f["spec"] for n, f in flavors.items()}
        queues = {q["metadata"]["name"]: q for q in _objects(plan, "ClusterQueue")}
        for team in cfg.teams:
            (group,) = queues[f"team-{team.name}"]["spec"]["resourceGroups"]
            offered = [f["name"] for f in group["flavors"]]
            assert offered[0] == "cpu", (stack, offered)
            quota = {r["name"]: r["nominalQuota"] for r in group["flavors"][0]["resources"]}
            assert quota == {"cpu": team.prepare_quota.cpus, "memory": f"{team.prepare_quota.memory_gi}Gi",
                             "nvidia.com/gpu": 0}, stack
            borrow = sum(t.prepare_quota.cpus for t in cfg.teams if t.name != team.name)
            assert group["flavors"][0]["resources"][0]["borrowingLimit"] == borrow
            request = PrepareRequest(name="web", team=team.name, inputs=("s3://b/raw/",), out="s3://b/x/web")
            rayjob = ray_job(request, contract)["spec"]["rayClusterSpec"]
            for template in (rayjob["headGroupSpec"]["template"], rayjob["workerGroupSpecs"][0]["template"]):
                pod = template["spec"]
                assert [n for n in offered if _flavor_fits(flavors[n], pod)] == ["cpu"], stack
                assert pod["nodeSelector"].items() <= system.items()
                assert not any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations") or [])


def test_a_plan_whose_job_outgrows_its_quota_fails_the_same_check(plans):
    """The check above on a broken copy of the aws-prod plan: research's nominal GPUs cut to 16."""
    plan = json.loads(json.dumps(plans["aws-prod"]))
    for res in plan["resources"]:
        inputs = res["inputs"]
        if inputs.get("kind") == "ClusterQueue" and inputs["metadata"]["name"] == "team-research":
            for f in inputs["spec"]["resourceGroups"][0]["flavors"]:
                for r in f["resources"]:
                    if r["name"] == "nvidia.com/gpu" and f["name"] == "h100-reserved":
                        r["nominalQuota"] = 16
    (jobset,) = _objects(plan, "JobSet")
    _, _, problems = _admission_problems(plan, jobset)
    # 16 nominal + 0 borrowable (applied has no h100-reserved quota) < 4 nodes x 8 GPUs.
    assert problems == ["pod set worker: insufficient quota for nvidia.com/gpu in flavor h100-reserved: 4 pods x 8 = "
                        "32 > maximum capacity 16"]


# Per-node agents on GPU nodes that come from Helm charts: release name -> value paths of the requests
# of the pods each GPU node runs (the Alluxio worker pod holds the worker and the job worker).
GPU_NODE_RELEASES = {
    "alluxio": ["worker.resources", "jobWorker.resources"],
    "dcgm-exporter": ["resources"],
    "kube-prometheus-stack": ["prometheus-node-exporter.resources"],
    "nvidia-device-plugin": ["resources", "nfd.worker.resources"],
    "aws-efa-k8s-device-plugin": ["resources"],
    "node-problem-detector": ["resources"],
    "fluent-bit": ["resources"],
}


def _tolerates_gpu_taint(pod_spec: dict) -> bool:
    from gpu_train.spec import naming

    return any(t.get("key") == naming.GPU_TAINT["key"] or (not t.get("key") and t.get("operator") == "Exists")
               for t in pod_spec.get("tolerations") or [])


def test_gpu_node_agents_fit_the_budget_the_trainer_leaves_them(plans):
    """GPU_NODE_AGENTS (what a trainer pod leaves on its node, infra/platform.py) covers every per-node agent the
    plan runs on GPU nodes, plus the clouds' own DaemonSets (CLOUD_AGENTS)."""
    for stack, plan in plans.items():
        cpu = memory = 0
        for ds in _objects(plan, "DaemonSet"):
            spec = ds["spec"]["template"]["spec"]
            if _tolerates_gpu_taint(spec):
                req = fit.pod_requests(spec)
                cpu, memory = cpu + req.get("cpu", 0), memory + req.get("memory", 0)
        for res in resources_of(plan, "kubernetes:helm.sh/v3:Release"):
            name, values = res["inputs"]["name"], res["inputs"].get("values") or {}
            for path in GPU_NODE_RELEASES.get(name, []):
                node = values
                for part in path.split("."):
                    node = node.get(part) or {} if isinstance(node, dict) else {}
                assert node.get("requests"), f"{stack}: release {name} sets no requests at {path}; update this table"
                req = {k: fit.quantity(v) for k, v in node["requests"].items()}
                cpu, memory = cpu + req.get("cpu", 0), memory + req.get("memory", 0)
        assert cpu + CLOUD_AGENTS_CPU <= GPU_NODE_AGENTS_CPU, (stack, float(cpu))
        assert memory + CLOUD_AGENTS_MEMORY <= GPU_NODE_AGENTS_MEMORY, (stack, float(memory) / 2**30)
        assert cpu > 0 and memory > 0


# --------------------------------------------------------------------------- broken stack files


def _from(stack: str, *mutations):
    def build() -> str:
        from tests.gpu_train.spec.test_settings import raw_stack

        raw = raw_stack(stack)
        for m in mutations:
            m(raw)
        return yaml.safe_dump({"config": raw})

    return build


def _text(body: str):
    return lambda: body


def _broken():
    from tests.gpu_train.spec.test_settings import _set

    s = _set
    return [
        # The trainer's schema, the batch at every world size, the quotas, the clouds.
        ("override-key", _from("aws-prod", s("job.overrides.train.micro_batchsize", 8)),
         "gpu-train:job.overrides.train.micro_batchsize"),
        ("override-value", _from("aws-prod", s("job.overrides.train.lr", "fast")), "gpu-train:job.overrides.train.lr"),
        ("override-nan", _from("aws-dev", s("job.overrides.train.lr", float("nan"))), "gpu-train:job.overrides.train.lr"),
        ("managed-override-steps", _from("aws-dev", s("job.overrides.train.steps", 5)),
         "gpu-train:job.overrides.train.steps is set by gpu-train:job.steps"),
        ("managed-override-uri", _from("gcp-dev", s("job.overrides.checkpoint.remote_uri", "gs://x/y")),
         "gpu-train:job.overrides.checkpoint.remote_uri is set by gpu-train:job.checkpointUri"),
        ("preset", _from("gcp-prod", s("job.preset", "gpt-9")), "gpu-train:job.preset 'gpt-9'"),
        ("batch-not-context-multiple", _from("aws-dev", s("job.globalBatchTokens", 65000)), "gpu-train:job.globalBatchTokens"),
        ("batch-not-micro-multiple", _from("aws-dev", s("job.overrides.train.micro_batch_size", 48)),
         "gpu-train:job.globalBatchTokens"),
        ("batch-world-24", _from("aws-prod", s("job.globalBatchTokens", 1048576),
                                 s("job.overrides.train.micro_batch_size", 16)),
         "gpu-train:job.globalBatchTokens 1048576 does not divide at world size 24"),
        ("batch-world-24-gcp", _from("gcp-prod", s("job.globalBatchTokens", 1048576),
                                     s("job.overrides.train.micro_batch_size", 16)), "at world size 24"),
        ("quota-zero", _from("aws-prod", s("teams[0].gpuQuota", 0)), "gpu-train:teams[0].gpuQuota"),
        ("quota-below-min", _from("aws-dev", s("teams[0].gpuQuota", {"l40s-spot": 2})), "gpu-train:teams[0].gpuQuota"),
        ("quota-impossible-aws", _from("aws-prod", s("teams[0].gpuQuota", {"h100-reserved": 16}),
                                       s("teams[1].gpuQuota", {"h100-reserved": 8, "h100-spot": 16})),
         "gpu-train:teams[0].gpuQuota: Kueue would not admit job 'gpt2-350m-pretrain'"),
        ("quota-impossible-gcp", _from("gcp-prod", s("teams[0].gpuQuota", {"h100-reserved": 24}),
                                       s("teams[1].gpuQuota", {"h100-spot": 16})), "gpu-train:teams[0].gpuQuota"),
        ("quota-unknown-pool", _from("aws-prod", s("teams[1].gpuQuota", {"h100": 16})), "gpu-train:teams[1].gpuQuota.h100"),
        ("quota-over-pool", _from("gcp-dev", s("teams[0].gpuQuota", {"l4-spot": 40})), "gpu-train:teams[0].gpuQuota.l4-spot"),
        ("quota-shape", _from("aws-dev", s("teams[0].gpuQuota", "lots")), "gpu-train:teams[0].gpuQuota"),
        ("prepare-quota", _from("gcp-dev", s("teams[0].prepareQuota", {"cpus": 2048})),
         "gpu-train:teams[0].prepareQuota.cpus must be <= 1024"),
        ("region-aws", _from("aws-dev", s("region", "us-north-1")), "gpu-train:region 'us-north-1'"),
        ("region-gcp", _from("gcp-prod", s("region", "europe-east1")), "gpu-train:region 'europe-east1'"),
        ("k8s-version", _from("aws-prod", s("cluster.kubernetesVersion", "1.40")), "gpu-train:cluster.kubernetesVersion"),
        ("k8s-version-channel", _from("gcp-prod", s("cluster.kubernetesVersion", "1.35")),
         "gpu-train:cluster.kubernetesVersion"),
        ("master-cidr-in-vpc", _from("gcp-prod", s("cluster.masterCidr", "10.40.1.0/28")), "gpu-train:cluster.masterCidr"),
        ("master-cidr-in-pods", _from("gcp-dev", s("cluster.masterCidr", "10.33.0.0/28")), "gpu-train:cluster.masterCidr"),
        ("fabric-no-room", _from("gcp-prod", s("network.serviceCidr", "192.168.0.0/16")),
         "gpu-train:network ranges leave no room for the GPU fabric subnets"),
        ("public-two-halves", _from("aws-prod", s("cluster.publicAccessCidrs", ["0.0.0.0/1", "128.0.0.0/1"])),
         "gpu-train:cluster.publicAccessCidrs"),
        ("public-everything", _from("gcp-prod", s("cluster.publicAccessCidrs", ["0.0.0.0/0"])),
         "gpu-train:cluster.publicAccessCidrs"),
        ("alert-negative", _from("aws-prod", s("monitoring.checkpointMaxAgeMinutes", -10)),
         "gpu-train:monitoring.checkpointMaxAgeMinutes"),
        ("utilization-negative", _from("gcp-dev", s("monitoring.lowUtilizationPercent", -5)),
         "gpu-train:monitoring.lowUtilizationPercent"),
        ("rendezvous-short", _from("aws-prod", s("job.rendezvousTimeoutMinutes", 5)), "gpu-train:job.rendezvousTimeoutMinutes"),
        ("data-wait-negative", _from("aws-dev", s("job.dataWaitMinutes", -1)), "gpu-train:job.dataWaitMinutes"),
        ("placeholder-cidr", _from("aws-prod", s("deploy", True)), "gpu-train:cluster.publicAccessCidrs[0]"),
        ("placeholder-project", _from("gcp-dev", s("deploy", True)), "gpu-train:project 'acme-ml-dev'"),
        # The settings' own shape and the platform's rules.
        ("unknown-key", _from("aws-dev", s("gpuPool", [])), "gpu-train:gpuPool is not a known setting"),
        ("wrong-type", _from("aws-dev", s("gpuPools[0].maxNodes", "four")), "gpu-train:gpuPools[0].maxNodes"),
        ("huge-number", _from("aws-dev", s("job.steps", 10**15)), "gpu-train:job.steps must be at most"),
        ("max-nodes-zero", _from("gcp-dev", s("gpuPools[0].maxNodes", 0)), "gpu-train:gpuPools[0].maxNodes"),
        ("min-over-max", _from("aws-prod", s("gpuPools[0].minNodes", 6)), "gpu-train:gpuPools[0].maxNodes"),
        ("instance-type", _from("aws-dev", s("gpuPools[0].instanceType", "g9.xlarge")), "gpu-train:gpuPools[0].instanceType"),
        # 4 vCPUs leave nothing for the trainer once the node agents have theirs.
        ("instance-too-small", _from("aws-dev", s("gpuPools[0].instanceType", "g6.xlarge")),
         "gpu-train:gpuPools[0].instanceType: g6.xlarge leaves the trainer 0 CPUs"),
        ("fabric-zone", _from("gcp-prod", s("gpuPools[1].zone", None)), "gpu-train:gpuPools[1].zone"),
        ("reservation", _from("gcp-prod", s("gpuPools[0].reservationId", None)), "gpu-train:gpuPools[0].reservationId"),
        ("cidr-overlap", _from("aws-dev", s("network.serviceCidr", "10.10.0.0/16")), "gpu-train:network.serviceCidr"),
        ("nat-prod", _from("aws-prod", s("network.nat", "single")), "gpu-train:network.nat"),
        ("public-no-cidrs", _from("aws-dev", s("cluster.endpointPublicAccess", True)), "gpu-train:cluster.publicAccessCidrs"),
        ("zone-region", _from("gcp-dev", s("zones", ["us-east1-b"])), "gpu-train:zones[0]"),
        ("one-zone-aws", _from("aws-prod", s("zones", ["us-east-1a"])), "gpu-train:zones must list at least two"),
        ("project-missing", _from("gcp-prod", s("project", None)), "gpu-train:project"),
        ("job-team", _from("aws-dev", s("job.team", "vision")), "gpu-train:job.team"),
        ("job-pool", _from("gcp-dev", s("job.pool", "a100")), "gpu-train:job.pool"),
        ("job-nodes", _from("aws-prod", s("job.nodes", "two:four")), "gpu-train:job.nodes"),
        ("job-nodes-max", _from("aws-prod", s("job.nodes", "2:6")), "gpu-train:job.nodes MAX 6"),
        ("gpus-per-node", _from("gcp-prod", s("job.gpusPerNode", 16)), "gpu-train:job.gpusPerNode"),
        ("dataset-scheme", _from("gcp-dev", s("job.datasetUri", "s3://b/m.json")), "gpu-train:job.datasetUri"),
        ("suspend-string", _from("aws-dev", s("job.suspend", "no")), "gpu-train:job.suspend"),
        ("image-tag", _from("gcp-dev", s("image.prebuilt", "trainer:v1")), "gpu-train:image.prebuilt"),
        ("retention", _from("aws-prod", s("monitoring.retention", "1 month")), "gpu-train:monitoring.retention"),
        ("cache-prod", _from("gcp-prod", s("cache.masters", 1)), "gpu-train:cache.masters"),
        ("max-gpus", _from("aws-prod", s("limits.maxGpus", 32)), "gpu-train:limits.maxGpus"),
        ("pools-not-mappings", _from("aws-dev", s("gpuPools", [None])), "gpu-train:gpuPools[0] must be a mapping"),
        ("job-not-mapping", _from("aws-dev", s("job", "train please")), "gpu-train:job must be a mapping"),
        ("not-yaml", _text("config:\n  gpu-train:cloud: [aws\n"), "not valid YAML"),
        ("no-config", _text("- just a list\n"), "must have a top-level 'config:' mapping"),
    ]


BROKEN = _broken()


@pytest.fixture(scope="session")
def broken_results(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Every broken file through `python -m infra.plan --stack-file`, two at a time."""
    from concurrent.futures import ThreadPoolExecutor

    work = tmp_path_factory.mktemp("broken-stacks")

    def run(case) -> tuple[str, subprocess.CompletedProcess]:
        name, build, _ = case
        path = work / f"Pulumi.broken-{name}.yaml"
        path.write_text(build())
        return name, run_plan("--stack-file", str(path), "--out", str(work / "out" / name))

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(pool.map(run, BROKEN))


def test_the_table_covers_every_class_of_bad_input():
    assert len(BROKEN) >= 45 and len({name for name, _, _ in BROKEN}) == len(BROKEN)


@pytest.mark.parametrize(("name", "key"), [(n, k) for n, _, k in BROKEN], ids=[n for n, _, _ in BROKEN])
def test_broken_stack_files_exit_2_naming_the_key_without_a_traceback(broken_results, name, key):
    proc = broken_results[name]
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert key in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stderr.startswith("error: ")


@pytest.mark.parametrize(("stack", "edit", "culprit"), [
    # Kueue could never admit the job: the research team's quota on h100-reserved shrinks below MAX 4 nodes x 8.
    ("aws-prod", lambda raw: raw["gpu-train:teams"][0].update(gpuQuota={"h100-reserved": 16, "h100-spot": 0}),
     "gpu-train:teams[0].gpuQuota"),
    # A setting only the cloud has a rule for (GKE's release channel does not offer 1.35).
    ("gcp-prod", lambda raw: raw["gpu-train:cluster"].update(kubernetesVersion="1.35"),
     "gpu-train:cluster.kubernetesVersion"),
])
def test_a_bad_setting_stops_the_program_before_any_cloud_resource(stack, edit, culprit, monkeypatch):
    """The checks that need the cloud layer's knowledge (its rules, the pools as jobs see them) run before the cloud
    layer builds anything: its build_platform is never called."""
    import importlib

    from gpu_train.spec.errors import SettingsError

    built = []
    layer = importlib.import_module(f"infra.{stack.split('-')[0]}")
    monkeypatch.setattr(layer, "build_platform", lambda *a, **k: built.append(a))
    raw = yaml.safe_load((ROOT / "stacks" / f"Pulumi.{stack}.yaml").read_text())["config"]
    edit(raw)
    with pytest.raises(SettingsError) as err:
        plan_tool.run_program(stack, raw)
    assert built == []
    assert any(p.startswith(culprit) for p in err.value.problems), err.value.problems
