"""`gpu-train submit`: the spec through the one job model and the stack's own checks, the JobSet from the one
renderer, and what is refused before any cluster is asked. Submitting to a cluster (what the API server stores,
Kueue's admission, RBAC's and the admission policies' refusals) is tests/cluster/test_cli_submit.py.

Run: .venv/bin/pytest tests/gpu_train/cli/test_submit.py -q
"""

from __future__ import annotations

import copy
import json

import kubernetes_validate
import pytest
import yaml

from gpu_train.jobs.jobset import HASH_ANNOTATION, PATH_ANNOTATION, QUEUE_LABEL
from gpu_train.spec import naming
from gpu_train.spec.contract import ContractError, PlatformContract
from gpu_train.spec.job import JobSpec
from infra.plan import kubernetes_objects
from tests.conftest import STACKS
from tests.gpu_train.cli.conftest import IMAGE, only_error_lines, spec
from tests.infra.k8s.checks import cr_problems
from tests.infra.k8s.harness import load_stack


def _platform_file(tmp_path, doc) -> str:
    path = tmp_path / "platform.json"
    path.write_text(json.dumps(doc))
    return str(path)


def _stack_spec(tmp_path, job: JobSpec):
    """The stack's job settings written as a job spec file (camelCase keys, as in the stack file)."""
    raw = job.model_dump(mode="json", by_alias=True)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))  # overrides keep their order, as in the stack file
    return path


@pytest.mark.parametrize("stack", STACKS)
def test_dry_run_is_the_stacks_jobset_but_for_the_queue_it_waits_in(plans, stack, tmp_path, cli):
    """Fed the stack's own `platform` output and its job settings, the command renders exactly the JobSet the
    plan holds; the one difference is where it waits: the team's queue, not the stack job's own queue."""
    plan = plans[stack]
    job = load_stack(stack).job
    (planned,) = [o for o in kubernetes_objects(plan) if o["kind"] == "JobSet"]
    code, out, err = cli("submit", _stack_spec(tmp_path, job), "--dry-run", "--platform",
                         _platform_file(tmp_path, plan["outputs"]["platform"]))
    assert code == 0, err
    printed = yaml.safe_load(out)
    queue = QUEUE_LABEL
    assert printed["metadata"]["labels"][queue] == f"{job.team}-queue"
    assert planned["metadata"]["labels"][queue] == naming.job_queue_name(job.name)
    printed["metadata"]["labels"][queue] = planned["metadata"]["labels"][queue]
    # Where each came from: the stack file, and the spec file (outside a git repository: no commit).
    mine, theirs = printed["metadata"].pop("annotations"), planned["metadata"].pop("annotations")
    assert theirs[PATH_ANNOTATION] == f"stacks/Pulumi.{stack}.yaml" and mine[PATH_ANNOTATION].endswith("job.yaml")
    assert set(mine) == set(theirs) == {HASH_ANNOTATION, PATH_ANNOTATION}
    assert printed == planned
    # ... and so it passes the same checks as the stack's: the JobSet CRD and its pod template as a strict Pod.
    assert cr_problems(printed) == []
    tpl = printed["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", **tpl["metadata"]},
                                  "spec": tpl["spec"]}, load_stack(stack).cluster.kubernetes_version, strict=True)


def test_two_specs_differ_only_where_their_settings_do(tmp_path, cli, doc):
    platform = _platform_file(tmp_path, doc)
    _, first, _ = cli("submit", spec(tmp_path), "--dry-run", "--platform", platform)
    _, second, _ = cli("submit", spec(tmp_path, maxRestarts=7), "--dry-run", "--platform", platform)
    a, b = yaml.safe_load(first), yaml.safe_load(second)
    assert a != b
    # Different JobSets, different config hashes (the annotation the renderer adds; docs/gitops.md).
    ha, hb = (x["metadata"].pop("annotations")[HASH_ANNOTATION] for x in (a, b))
    assert ha != hb and ha.startswith("sha256:") and len(ha) == len("sha256:") + 64
    assert a["spec"]["failurePolicy"]["maxRestarts"] == 5 and b["spec"]["failurePolicy"]["maxRestarts"] == 7
    for obj in (a, b):
        obj["spec"]["failurePolicy"].pop("maxRestarts")
        rjob = obj["spec"]["replicatedJobs"][0]["template"]["spec"]
        rjob.pop("backoffLimit")  # maxRestarts x MAX nodes
        args = rjob["template"]["spec"]["containers"][0]["args"]
        args.remove(next(x for x in args if x.startswith("--max-restarts=")))
    assert a == b


def test_bad_settings_are_all_named_by_the_stacks_own_checks(tmp_path, cli, doc):
    bad = spec(tmp_path, steps=0, stepz=3, overrides={"train.steps": 9})
    code, _, err = cli("submit", bad, "--dry-run", "--platform", _platform_file(tmp_path, doc))
    assert code == 2 and only_error_lines(err)
    assert f"{bad}: job.stepz is not a known setting (did you mean 'steps'?)" in err


def test_checks_after_reading(tmp_path, cli, doc):
    """A spec whose values all have their types and ranges gets every check across settings, all at once; a value
    out of its range is refused when read, before them."""
    bad = spec(tmp_path, overrides={"train.steps": 9}, nodes="1:9")
    code, _, err = cli("submit", bad, "--dry-run", "--platform", _platform_file(tmp_path, doc))
    assert code == 2 and only_error_lines(err)
    assert "job.overrides.train.steps is set by job.steps; set that instead" in err
    assert "job.nodes MAX 9 is more than pool 'l4-spot' maxNodes 4" in err
    code, _, err = cli("submit", spec(tmp_path, steps=0), "--dry-run", "--platform", _platform_file(tmp_path, doc))
    assert code == 2 and err.strip().endswith("job.steps must be >= 1 (got 0)")


def test_a_node_range_that_is_not_one_is_refused_when_read(tmp_path, cli, doc):
    bad = spec(tmp_path, steps=0, nodes="3:2")
    code, _, err = cli("submit", bad, "--dry-run", "--platform", _platform_file(tmp_path, doc))
    assert code == 2 and only_error_lines(err)
    assert "job.nodes must be MIN:MAX with 1 <= MIN <= MAX, like '2:4' (got '3:2')" in err


def test_no_kubeconfig(tmp_path, cli):
    code, _, err = cli("submit", spec(tmp_path))
    assert code == 2 and only_error_lines(err)
    assert "no kubeconfig:" in err and "does not exist and KUBECONFIG is not set" in err
    assert "gpu-train kubeconfig --platform platform.json --team <team>" in err


def test_broken_spec_files(tmp_path, cli, doc):
    platform = _platform_file(tmp_path, doc)
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    (tmp_path / "broken.yaml").write_text("name: [unclosed\n")
    for path, needle in ((tmp_path / "missing.yaml", "no such job spec file"),
                         (tmp_path / "list.yaml", "a job spec is a mapping"),
                         (tmp_path / "broken.yaml", "not valid YAML")):
        code, _, err = cli("submit", path, "--dry-run", "--platform", platform)
        assert code == 2 and only_error_lines(err) and needle in err, err


def test_a_contract_of_another_format_is_refused(tmp_path, cli, doc):
    doc = {**doc, "apiVersion": "gpu-train.io/v2"}
    code, _, err = cli("submit", spec(tmp_path), "--dry-run", "--platform", _platform_file(tmp_path, doc))
    assert code == 2 and "this gpu-train reads gpu-train.io/v1/PlatformContract" in err


def test_the_contract_round_trips_to_the_stacks_objects(doc):
    c = PlatformContract.from_document(doc, "test")
    pool = c.pool("l4-spot")
    assert (pool.instance_type, pool.gpus_per_node, pool.max_nodes) == ("g6.2xlarge", 1, 4)
    team = c.team("research")
    assert team.namespace == naming.team_namespace("research") and team.local_queue == "research-queue"
    assert team.nvme_workdir == "/mnt/k8s-disks/0/gpu-train/team-research"
    assert team.gpu_quota == {"l4-spot": 4, "l40s-spot": 0}
    with pytest.raises(ContractError, match="pools: l4-spot, l40s-spot"):
        c.pool("h100")
    broken = copy.deepcopy(doc)
    del broken["pools"][0]["instanceType"]
    with pytest.raises(ContractError, match=r"test: pools\[0\]\.instanceType is required"):
        PlatformContract.from_document(broken, "test")
    assert c.image == IMAGE
