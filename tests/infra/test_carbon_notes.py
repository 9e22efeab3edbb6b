"""The plan's carbon lines for the example stacks: the job's estimate, the greener regions for its pool, and the
advisory when the region is more than twice the best allowed one; carbon.allowedRegions is checked and used.

Run: .venv/bin/pytest tests/infra/test_carbon_notes.py -q
"""

from __future__ import annotations

import pytest

from gpu_train.spec.errors import SettingsError
from gpu_train.spec.settings_checks import parse
from infra.carbon import plan_notes
from tests.conftest import ROOT


def load_stack(stack: str, **over):
    """A stack's settings, with some settings replaced, checked as the program checks them."""
    import yaml

    from infra import clouds

    raw = yaml.safe_load((ROOT / "stacks" / f"Pulumi.{stack}.yaml").read_text())["config"]
    cfg = parse({**raw, **over}, stack)
    clouds.require_valid(cfg)
    return cfg


def test_gcp_prod_gets_an_estimate_and_an_advisory():
    job, greener, advisory = plan_notes(load_stack("gcp-prod"))
    assert job.startswith("job gpt2-350m-pretrain: carbon: ~") and "in us-central1 (413 gCO2e/kWh, PUE 1.09;" in job
    assert greener.startswith("job gpt2-350m-pretrain: greener regions for a3-megagpu-8g: us-west1 79")
    # us-central1 412.72 / us-west1 79.23 = 5.2, above the 2x threshold (both in the US, both offer A3 Mega).
    assert advisory.startswith("carbon: region us-central1 runs on 413 gCO2e/kWh, 5.2x the best allowed region")


def test_aws_prod_stays_within_its_partition_and_gets_no_advisory():
    notes = plan_notes(load_stack("aws-prod"))
    assert len(notes) == 2  # us-east-1 379 is not above 2 x us-west-2 322
    assert "us-gov" not in notes[1] and "us-west-2 322" in notes[1]


def test_allowed_regions_setting_is_used_and_checked():
    cfg = load_stack("gcp-prod", **{"gpu-train:carbon": {"allowedRegions": ["EU", "US"]}})
    advisory = plan_notes(cfg)[-1]
    # EU and US regions offering a3-megagpu-8g: the best is europe-north1 at 39.32; 412.72 / 39.32 = 10.5x.
    assert "10.5x" in advisory and "europe-north1" in advisory
    with pytest.raises(SettingsError, match=r"gpu-train:carbon.allowedRegions\[1\]: 'Mars' is neither"):
        load_stack("gcp-prod", **{"gpu-train:carbon": {"allowedRegions": ["EU", "Mars"]}})
