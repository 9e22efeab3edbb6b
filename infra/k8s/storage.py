"""The encrypted block StorageClass every persistent volume of this layer uses.

Usage: `EncryptedStorage("storage", StorageArgs(platform=platform, retain=cfg.is_prod))`; then
`storage.name` in Helm values (Prometheus, Grafana, Alluxio journal). The class comes from the
cloud's `platform.storage_class` spec (customer-managed KMS key in its parameters).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pulumi
import pulumi_kubernetes as k8s

from infra.k8s.common import k8s_opts
from infra.platform import ClusterPlatform, StorageClassSpec


@dataclass(frozen=True, kw_only=True)
class StorageArgs:
    platform: ClusterPlatform  # provider + storage_class spec
    retain: bool  # keep volumes when their claim is deleted (prod: journal and metrics survive)


def storage_class_fields(spec: StorageClassSpec, retain: bool) -> dict[str, Any]:
    """StorageClass fields from the platform's spec; refuses a spec without an encryption key."""
    params = dict(spec.parameters)
    if not any(k.lower() in ("kmskeyid", "disk-encryption-kms-key", "encrypted") for k in params):
        raise ValueError(f"platform.storage_class {spec.name!r} has no encryption parameter "
                         f"(kmsKeyId / disk-encryption-kms-key); refusing an unencrypted StorageClass")
    return {
        "metadata": {"name": spec.name, "labels": {"app.kubernetes.io/managed-by": "pulumi"}},
        "provisioner": spec.provisioner,
        "parameters": params,
        "volume_binding_mode": spec.volume_binding_mode,
        "allow_volume_expansion": True,
        "reclaim_policy": "Retain" if retain else "Delete",
    }


class EncryptedStorage(pulumi.ComponentResource):
    """One StorageClass, encrypted with the platform's key."""

    def __init__(self, name: str, args: StorageArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:k8s:EncryptedStorage", name, None, opts)
        spec = args.platform.storage_class
        self.storage_class = k8s.storage.v1.StorageClass(
            f"{name}-class", **storage_class_fields(spec, args.retain),
            opts=k8s_opts(args.platform, self, args.platform.ready))
        self.name: str = spec.name
        self.register_outputs({"name": self.name})
