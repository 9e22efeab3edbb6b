"""A GitHub Actions runner inside the VPC (AWS CodeBuild-hosted), so deploys reach the private EKS endpoint.

Usage:
    runner = DeployRunner("deploy-runner", DeployRunnerArgs(...))
    runner.runs_on        # the `runs-on:` label a workflow job uses to run on it
    runner_label(project) # pure: that label for a project name

The EKS API endpoint is private (a public one is only an option for admins' CIDRs), and GitHub's hosted
runners are outside the VPC. CodeBuild can host GitHub Actions runners: a project with a webhook on
`WORKFLOW_JOB_QUEUED` starts a build for every queued job whose `runs-on` names the project, and the
build registers as a just-in-time runner for that one job
(https://docs.aws.amazon.com/codebuild/latest/userguide/action-runner.html). The project here runs in
the cluster's private node subnets with its own security group, and the cluster security group admits
HTTPS from that group only, so a job on it reaches the API server by its private address.

The runner gets no AWS permissions beyond what CodeBuild needs for itself (its network interfaces, its
log group and the CodeConnections connection to GitHub); the deploy job still assumes the deploy role
through GitHub's OIDC token, as on a hosted runner. It is privileged (Docker) because `pulumi up` builds
the trainer image. What a user sets up by hand (the GitHub connection) is in docs/aws.md, Deploying.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import pulumi
import pulumi_aws as aws

from infra.aws import iam

# CodeBuild-managed Ubuntu image with Docker: the workflows use actions/setup-python, whose builds are for
# Ubuntu (https://github.com/actions/python-versions), not Amazon Linux.
IMAGE = "aws/codebuild/standard:7.0"
COMPUTE_TYPE = "BUILD_GENERAL1_LARGE"  # 8 vCPU / 15 GB: the trainer image build installs torch
LOG_RETENTION_DAYS = 90
HTTPS = 443


def runner_label(project: str) -> str:
    """The `runs-on:` value that routes a GitHub Actions job to this CodeBuild project."""
    return f"codebuild-{project}-${{{{ github.run_id }}}}-${{{{ github.run_attempt }}}}"


def repository_url(repository: str) -> str:
    """https://github.com/<owner>/<name> from "<owner>/<name>"; rejects anything else by name."""
    parts = repository.split("/")
    if len(parts) != 2 or not all(parts) or any(c in repository for c in " :@"):
        raise ValueError(f"gpu-train:deployRunner.repository must be a GitHub <owner>/<name> (got {repository!r})")
    return f"https://github.com/{repository}"


@dataclass(frozen=True, kw_only=True)
class DeployRunnerArgs:
    project: str  # CodeBuild project name (and the runner label's middle part)
    region: str  # log group and network-interface ARNs
    account_id: str  # ARNs and trust
    vpc_id: pulumi.Input[str]  # the cluster VPC
    subnet_ids: Sequence[pulumi.Input[str]]  # private node subnets (NAT egress to GitHub)
    cluster_security_group_id: pulumi.Input[str]  # admits HTTPS from the runner
    logs_key_arn: pulumi.Input[str]  # KMS key of the build log group
    repository: str  # GitHub <owner>/<name> whose workflow jobs run here
    connection_arn: str  # CodeConnections connection to GitHub (created and authorized by hand)
    tags: Mapping[str, str]  # common tags


class DeployRunner(pulumi.ComponentResource):
    def __init__(self, name: str, args: DeployRunnerArgs, opts: pulumi.ResourceOptions | None = None):
        super().__init__("gpu-train:aws:DeployRunner", name, None, opts)
        child = pulumi.ResourceOptions(parent=self)
        tags = dict(args.tags)
        location = repository_url(args.repository)

        self.security_group = aws.ec2.SecurityGroup(
            name, vpc_id=args.vpc_id, description=f"{args.project}: deploy jobs (no inbound)",
            # Outbound HTTPS only: GitHub, Pulumi Cloud, package and chart registries, AWS APIs, the API server.
            egress=[aws.ec2.SecurityGroupEgressArgs(protocol="tcp", from_port=HTTPS, to_port=HTTPS,
                                                    cidr_blocks=["0.0.0.0/0"], description="HTTPS out")],
            tags={**tags, "Name": args.project}, opts=child)
        aws.vpc.SecurityGroupIngressRule(
            f"{name}-api", security_group_id=args.cluster_security_group_id, ip_protocol="tcp", from_port=HTTPS,
            to_port=HTTPS, referenced_security_group_id=self.security_group.id,
            description="Kubernetes API from the deploy runner", tags=tags, opts=child)

        log_group = aws.cloudwatch.LogGroup(name, name=f"/aws/codebuild/{args.project}",
                                            retention_in_days=LOG_RETENTION_DAYS, kms_key_id=args.logs_key_arn,
                                            tags=tags, opts=child)
        role = aws.iam.Role(name, name=args.project,
                            assume_role_policy=json.dumps(iam.service_trust("codebuild.amazonaws.com",
                                                                            args.account_id)),
                            tags=tags, opts=child)
        policy = aws.iam.RolePolicy(name, role=role.id, policy=pulumi.Output.all(
            log_group.arn, *args.subnet_ids).apply(lambda a: json.dumps(iam.codebuild_runner_policy(
                region=args.region, account_id=args.account_id, log_group_arn=a[0], subnet_ids=a[1:],
                connection_arn=args.connection_arn))), opts=child)

        self.project = aws.codebuild.Project(
            name, name=args.project, description="GitHub Actions runner for deploy jobs, inside the cluster VPC",
            service_role=role.arn, build_timeout=120,
            source=aws.codebuild.ProjectSourceArgs(
                type="GITHUB", location=location,
                auth=aws.codebuild.ProjectSourceAuthArgs(type="CODECONNECTIONS", resource=args.connection_arn)),
            artifacts=aws.codebuild.ProjectArtifactsArgs(type="NO_ARTIFACTS"),
            environment=aws.codebuild.ProjectEnvironmentArgs(
                type="LINUX_CONTAINER", compute_type=COMPUTE_TYPE, image=IMAGE, privileged_mode=True),
            vpc_config=aws.codebuild.ProjectVpcConfigArgs(vpc_id=args.vpc_id, subnets=list(args.subnet_ids),
                                                          security_group_ids=[self.security_group.id]),
            logs_config=aws.codebuild.ProjectLogsConfigArgs(
                cloudwatch_logs=aws.codebuild.ProjectLogsConfigCloudwatchLogsArgs(
                    status="ENABLED", group_name=log_group.name)),
            tags=tags, opts=pulumi.ResourceOptions(parent=self, depends_on=[policy]))
        aws.codebuild.Webhook(
            name, project_name=self.project.name, build_type="BUILD",
            filter_groups=[aws.codebuild.WebhookFilterGroupArgs(filters=[
                aws.codebuild.WebhookFilterGroupFilterArgs(type="EVENT", pattern="WORKFLOW_JOB_QUEUED")])],
            opts=child)
        self.runs_on = runner_label(args.project)
        self.register_outputs({"project": self.project.name, "security_group": self.security_group.id})
