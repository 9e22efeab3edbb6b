"""The examples' job specs on the cluster: `gpu-train submit --dry-run` renders each into a JobSet that passes the
checks the bundled trainer's passes (the JobSet CRD, its pod template as a strict Pod, the policy pack's pod
rules) and differs from the bundled trainer's JobSet of the same spec only in the image and the command. The team
namespaces' admission policies admitting each on a real API server: tests/cluster/test_cli_submit.py.

Run: .venv/bin/pytest tests/examples/test_specs.py -q
"""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from gpu_train.jobs.jobset import COMMIT_ANNOTATION, HASH_ANNOTATION, PATH_ANNOTATION
from gpu_train.spec import env as job_env
from policies import pods
from tests.gpu_train.cli.conftest import IMAGE, REGISTRY
from tests.infra.k8s.checks import cr_problems

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ("plain-loop", "hf-gpt2")
NVME = "/mnt/k8s-disks/0"


def _image(example: str) -> str:
    """Where a team pushes the example's image: its own repository in the platform registry."""
    return f"{REGISTRY}research/{example}@sha256:" + "e" * 64


def _container(obj: dict) -> dict:
    return obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]


def _dry_run(cli, spec: Path, platform: Path, *extra: str) -> dict:
    code, out, err = cli("submit", spec, "--dry-run", "--platform", platform, *extra)
    assert code == 0, err
    return yaml.safe_load(out)


def _checks(obj: dict) -> list[str]:
    """The CRD, the strict Pod schema, and the policy pack's pod rules for a team namespace."""
    tpl = obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", **tpl["metadata"]},
                                  "spec": tpl["spec"]}, "1.33", strict=True)
    return [*cr_problems(obj), *pods.host_isolation_problems(obj, [NVME]), *pods.non_root_problems(obj),
            *pods.training_problems(obj), *pods.registry_problems(obj, [REGISTRY])]


@pytest.mark.parametrize("example", EXAMPLES)
def test_an_examples_jobset_is_the_bundled_trainers_but_for_image_and_command(example, tmp_path, cli, doc):
    platform = tmp_path / "platform.json"
    platform.write_text(json.dumps(doc))
    spec = ROOT / "examples" / example / "job.yaml"
    raw = yaml.safe_load(spec.read_text())
    bundled_spec = tmp_path / "bundled.yaml"  # the same job, running the bundled trainer in the platform's image
    bundled_spec.write_text(yaml.safe_dump({k: v for k, v in raw.items() if k != "command"}))
    mine = _dry_run(cli, spec, platform, "--image", _image(example))
    theirs = _dry_run(cli, bundled_spec, platform)
    assert _checks(mine) == [] and _checks(theirs) == []

    a, b = _container(mine), _container(theirs)
    assert (a["image"], b["image"]) == (_image(example), IMAGE)
    assert a["command"] == b["command"] == ["gpu-train-launch"]
    # torchrun's arguments are the same; what follows is the job's command (the script form of torchrun) or the
    # bundled trainer's module and settings.
    torchrun = a["args"][: a["args"].index("train.py")]
    assert b["args"][: len(torchrun)] == torchrun and b["args"][len(torchrun):][:2] == ["-m", "trainer"]
    assert a["args"][len(torchrun):] == raw["command"][1:]
    digest = {"name": job_env.IMAGE_DIGEST, "value": _image(example).split("@")[1]}
    assert digest in a["env"] and {**digest, "value": IMAGE.split("@")[1]} in b["env"]

    # Everything else is the same object: take the image, the command and the spec's own annotations out (the
    # example's spec file is in git, so its JobSet also names the commit when the file is unchanged; the copy in
    # tmp_path is in no repository).
    assert set(mine["metadata"].pop("annotations")) - {COMMIT_ANNOTATION} == {HASH_ANNOTATION, PATH_ANNOTATION}
    assert set(theirs["metadata"].pop("annotations")) == {HASH_ANNOTATION, PATH_ANNOTATION}
    for c in (a, b):
        c.pop("image")
        c["args"] = c["args"][: len(torchrun)]
        c["env"] = [e for e in c["env"] if e["name"] != job_env.IMAGE_DIGEST]
    assert mine == theirs


def test_a_command_without_an_image_is_rendered_with_a_note_that_the_platform_image_lacks_the_code(tmp_path, cli,
                                                                                                     doc):
    platform = tmp_path / "platform.json"
    platform.write_text(json.dumps(doc))
    spec = ROOT / "examples" / "plain-loop" / "job.yaml"
    code, out, err = cli("submit", spec, "--dry-run", "--platform", platform)
    assert code == 0 and _container(yaml.safe_load(out))["image"] == IMAGE
    (note,) = [line for line in err.splitlines() if line.startswith("gpu-train: note: ")]
    assert note == (f"gpu-train: note: {spec}: command 'python train.py --steps 200 --checkpoint-every 10' runs in "
                    f"the platform's trainer image ({IMAGE}), which holds the trainer library but not your code: "
                    "build your image on it and set `image` (docs/your-code.md)")
    _, _, err = cli("submit", spec, "--dry-run", "--platform", platform, "--image", _image("plain-loop"))
    assert "gpu-train: note:" not in err


@pytest.mark.parametrize("example", EXAMPLES)
def test_an_examples_image_is_the_trainer_image_plus_its_folder(example):
    """Built FROM the platform's trainer image (a build argument) with the folder copied to /workspace, where the
    job's command runs (the trainer image's WORKDIR, tests/infra/test_image.py), as the job's user."""
    from dockerfile_parse import DockerfileParser

    steps = [(i["instruction"], i["value"]) for i in DockerfileParser(
        str(ROOT / "examples" / example / "Dockerfile")).structure if i["instruction"] != "COMMENT"]
    assert steps[:2] == [("ARG", "BASE"), ("FROM", "${BASE}")]
    assert steps[-1] == ("COPY", ". /workspace")
    users = [v for k, v in steps if k == "USER"]
    assert not users or users[-1] == "10001:10001"
    command = yaml.safe_load((ROOT / "examples" / example / "job.yaml").read_text())["command"]
    assert (ROOT / "examples" / example / command[1]).is_file()  # the script the command names is in the folder
