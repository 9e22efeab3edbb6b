"""AWS answers for offline plans: invokes the program calls and provider-computed properties.

Usage: used by `infra.mocks.PlanMocks`; see that module for what a mock answers. Instance-type answers come
from the tested catalog (gpu_train/spec/catalog/aws.py), so the offline plan attaches the same number of EFA
interfaces a real `pulumi up` would.
"""

from __future__ import annotations

import base64
import hashlib
from typing import Any

from gpu_train.spec.catalog.aws import CATALOG
from infra.aws import service_roles

# Offline stand-ins, shaped like `aws eks describe-addon-versions` output for Kubernetes 1.33.
_ADDON_VERSIONS = {
    "kube-proxy": "v1.33.0-eksbuild.2",
    "coredns": "v1.12.1-eksbuild.2",
    "eks-pod-identity-agent": "v1.3.7-eksbuild.2",
    "aws-ebs-csi-driver": "v1.45.0-eksbuild.2",
    "vpc-cni": "v1.20.1-eksbuild.3",
}


def _hex(*parts: str, n: int = 17) -> str:
    return hashlib.sha256("/".join(parts).encode()).hexdigest()[:n]


def _instance_type(instance_type: str) -> dict[str, Any]:
    spec = CATALOG.get(instance_type)
    if spec is None:
        raise KeyError(f"offline plan: no catalog entry for EC2 instance type {instance_type!r}")
    gpus = [{"count": spec.gpus, "manufacturer": "NVIDIA", "name": spec.gpu_type, "memorySize": 0}] \
        if spec.accelerator == "nvidia" else []
    return {
        "instanceType": instance_type, "id": instance_type,
        "maximumNetworkCards": spec.network_cards, "efaSupported": spec.efa,
        "efaMaximumInterfaces": spec.network_cards if spec.efa else 0,
        "defaultVcpus": spec.vcpus, "memorySize": spec.memory_gib * 1024, "gpuses": gpus,
        "instanceStorageSupported": spec.nvme_disks > 0,
        "totalInstanceStorage": spec.nvme_disks * spec.nvme_gb_each,
        "instanceDisks": [{"count": spec.nvme_disks, "size": spec.nvme_gb_each, "type": "ssd"}],
        "networkCards": [{"index": i, "maximumNetworkInterfaces": 2} for i in range(spec.network_cards)],
    }


def invoke(token: str, args: dict[str, Any], ctx) -> dict[str, Any] | None:
    region = ctx.region
    if token == "aws:index/getAvailabilityZones:getAvailabilityZones":
        names = [f"{region}{s}" for s in "abcdef"]
        return {"names": names, "zoneIds": [f"use1-az{i}" for i in range(1, 7)], "id": region}
    if token == "aws:index/getCallerIdentity:getCallerIdentity":
        return {"accountId": ctx.account_id, "arn": f"arn:aws:iam::{ctx.account_id}:user/ci",
                "userId": "AIDAEXAMPLE", "id": ctx.account_id}
    if token == "aws:index/getPartition:getPartition":
        return {"partition": "aws", "dnsSuffix": "amazonaws.com", "id": "aws"}
    if token == "aws:index/getRegion:getRegion":
        return {"name": region, "region": region, "id": region, "endpoint": f"ec2.{region}.amazonaws.com"}
    if token == "aws:ec2/getInstanceType:getInstanceType":
        return _instance_type(args["instanceType"])
    if token == "aws:ssm/getParameter:getParameter":
        name = args["name"]
        if not name.startswith("/aws/service/eks/optimized-ami/"):
            raise KeyError(f"offline plan: no mock for SSM parameter {name!r}")
        return {"name": name, "id": name, "type": "String", "value": f"ami-0{_hex(name)}", "version": 1,
                "arn": f"arn:aws:ssm:{region}::parameter{name}", "withDecryption": True, "insecureValue": ""}
    if token == "aws:ecr/getAuthorizationToken:getAuthorizationToken":
        registry = args.get("registryId") or ctx.account_id
        password = "mock-" + _hex("ecr", registry, n=32)
        return {"id": region, "registryId": registry, "userName": "AWS", "password": password,
                "authorizationToken": base64.b64encode(f"AWS:{password}".encode()).decode(),
                "proxyEndpoint": f"https://{registry}.dkr.ecr.{region}.amazonaws.com",
                "expiresAt": "2030-01-01T00:00:00Z"}
    if token == "aws:iam/getRoles:getRoles":
        # Service-linked roles the (mocked) account already has: MockContext.service_linked_roles.
        prefix, pattern = args.get("pathPrefix", ""), args.get("nameRegex", "")
        found = [s for s in getattr(ctx, "service_linked_roles", ())
                 if service_roles.role_path(s) == prefix and pattern == f"^{service_roles.ROLE_NAMES[s]}$"]
        return {"id": ctx.account_id, "pathPrefix": prefix, "nameRegex": pattern,
                "names": [service_roles.ROLE_NAMES[s] for s in found],
                "arns": [service_roles.role_arn(ctx.account_id, s) for s in found]}
    if token == "aws:eks/getAddonVersion:getAddonVersion":
        addon = args["addonName"]
        return {"id": addon, "addonName": addon, "kubernetesVersion": args["kubernetesVersion"],
                "version": _ADDON_VERSIONS[addon], "mostRecent": bool(args.get("mostRecent"))}
    return None


def computed(typ: str, name: str, inputs: dict[str, Any], ctx) -> dict[str, Any]:
    if not typ.startswith("aws:"):
        return {}
    region, account = ctx.region, ctx.account_id
    service = typ.split(":")[1].split("/")[0]
    out: dict[str, Any] = {"arn": f"arn:aws:{service}:{region}:{account}:{name}"}
    if typ == "aws:eks/cluster:Cluster":
        cname = inputs.get("name", name)
        oidc = _hex("oidc", cname, n=32).upper()
        out.update({
            "arn": f"arn:aws:eks:{region}:{account}:cluster/{cname}",
            "endpoint": f"https://{oidc}.gr7.{region}.eks.amazonaws.com",
            "certificateAuthority": {"data": base64.b64encode(f"mock CA for {cname}".encode()).decode()},
            "identities": [{"oidcs": [{"issuer": f"https://oidc.eks.{region}.amazonaws.com/id/{oidc}"}]}],
            "vpcConfig": {**(inputs.get("vpcConfig") or {}), "clusterSecurityGroupId": f"sg-0{_hex('cluster', cname)}",
                          "vpcId": "vpc-0mock"},
            "status": "ACTIVE", "platformVersion": "eks.1",
        })
    elif typ == "aws:iam/role:Role":
        rname = inputs.get("name") or f"{name}-{_hex(name, n=7)}"
        out.update({"name": rname, "arn": f"arn:aws:iam::{account}:role/{rname}", "uniqueId": f"AROA{_hex(name)}"})
    elif typ == "aws:iam/serviceLinkedRole:ServiceLinkedRole":
        service = inputs["awsServiceName"]
        out.update({"arn": service_roles.role_arn(account, service), "name": service_roles.ROLE_NAMES[service],
                    "path": service_roles.role_path(service)})
    elif typ == "aws:kms/key:Key":
        key_id = "mrk-" + _hex("kms", name, n=32)
        out.update({"keyId": key_id, "arn": f"arn:aws:kms:{region}:{account}:key/{key_id}"})
    elif typ == "aws:s3/bucket:Bucket":
        bucket = inputs.get("bucket") or name
        out.update({"bucket": bucket, "arn": f"arn:aws:s3:::{bucket}", "region": region,
                    "bucketRegionalDomainName": f"{bucket}.s3.{region}.amazonaws.com"})
    elif typ == "aws:ecr/repository:Repository":
        repo = inputs.get("name") or name
        out.update({"name": repo, "registryId": account, "arn": f"arn:aws:ecr:{region}:{account}:repository/{repo}",
                    "repositoryUrl": f"{account}.dkr.ecr.{region}.amazonaws.com/{repo}"})
    elif typ == "aws:sqs/queue:Queue":
        qname = inputs.get("name") or name
        out.update({"name": qname, "arn": f"arn:aws:sqs:{region}:{account}:{qname}",
                    "url": f"https://sqs.{region}.amazonaws.com/{account}/{qname}"})
    elif typ == "aws:ec2/launchTemplate:LaunchTemplate":
        out.update({"latestVersion": 1, "defaultVersion": 1})
    elif typ in ("aws:cloudwatch/eventRule:EventRule", "aws:ec2/placementGroup:PlacementGroup"):
        out["name"] = inputs.get("name") or f"{name}-{_hex(name, n=7)}"
    elif typ == "aws:cloudwatch/logGroup:LogGroup":
        out["arn"] = f"arn:aws:logs:{region}:{account}:log-group:{inputs.get('name', name)}"
    elif typ == "aws:rds/instance:Instance":
        ident = inputs.get("identifier") or f"{name}-{_hex(name, n=7)}"
        address = f"{ident}.c{_hex('rds', account, region, n=11)}.{region}.rds.amazonaws.com"
        port = int(inputs.get("port") or 5432)
        out.update({"identifier": ident, "address": address, "endpoint": f"{address}:{port}", "port": port,
                    "arn": f"arn:aws:rds:{region}:{account}:db:{ident}", "resourceId": f"db-{_hex(ident).upper()}",
                    "engineVersionActual": inputs.get("engineVersion"), "hostedZoneId": "Z2R2ITUGPM61AM"})
    elif typ in ("aws:rds/subnetGroup:SubnetGroup", "aws:rds/parameterGroup:ParameterGroup"):
        out["name"] = inputs.get("name") or f"{name}-{_hex(name, n=7)}"
    elif typ == "aws:iam/openIdConnectProvider:OpenIdConnectProvider":
        url = str(inputs.get("url", "")).removeprefix("https://")
        out["arn"] = f"arn:aws:iam::{account}:oidc-provider/{url}"
    return out
