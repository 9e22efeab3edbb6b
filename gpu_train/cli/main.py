"""The `gpu-train` console script: argument parsing and one-line errors (pyproject [project.scripts]).

Usage: `gpu-train --help`, `gpu-train <command> --help` (docs/teams.md walks through every command).
Every failure the user can act on ends in one `gpu-train: error: ...` line (several for several bad
settings) and exit status 2 (fix the input) or 1 (the cluster or cloud refused or failed); never a traceback.
"""

from __future__ import annotations

import argparse
import re
import sys

from gpu_train.cli import platform, sweep
from gpu_train.client.errors import ClientError, NoCluster, quiet_client_logs

PROG = "gpu-train"
# What lint, apply, submit and sweep say when they have neither a cluster nor a --platform file.
PLATFORM_HINT = ("without a cluster, give --platform FILE: `gpu-train platform --stack <stack>` writes one from the "
                 "offline plan (docs/gitops.md)")


def _common(p: argparse.ArgumentParser, team: bool = True) -> None:
    g = p.add_argument_group("cluster")
    g.add_argument("--kubeconfig", help="kubeconfig file (default: $KUBECONFIG, else ~/.kube/config)")
    g.add_argument("--context", help="kubeconfig context (default: its current context)")
    if team:
        g.add_argument("--team", help="your team (default: the team whose namespace the context points at)")
    g.add_argument("--platform", metavar="FILE",
                   help="platform contract (`pulumi stack output platform --json`); default: the one the cluster "
                        "publishes in the team's namespace")


def parser() -> argparse.ArgumentParser:
    import dataclasses

    from gpu_train.jobs.prepare import PrepareRequest

    ap = argparse.ArgumentParser(
        prog=PROG, description="Run your team's training jobs on the gpu-train platform: submit a job spec, follow "
                               "it, read its logs (also after its pods are gone), pause, resume or cancel it, or run "
                               "the same spec on this machine.",
        epilog="A job spec file holds the stack's `job` settings (name, team, pool, preset, nodes, steps, ...); see "
               "docs/teams.md.")
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")

    k = sub.add_parser("kubeconfig", help="write a kubeconfig scoped to your team",
                       description="Write a kubeconfig whose context points at your team's namespace, from the "
                                   "platform contract. It holds no credential: requests authenticate through the "
                                   "cloud CLI (aws eks get-token / gke-gcloud-auth-plugin).")
    k.add_argument("--platform", metavar="FILE", required=True, help="platform contract (from the platform team)")
    k.add_argument("--team", required=True, help="your team")
    k.add_argument("--aws-profile", default="", help="EKS: the AWS profile you sign in with (sets AWS_PROFILE)")
    k.add_argument("--role-arn", default="", help="EKS: the IAM role your access entry names, assumed per request")
    k.add_argument("--output", "-o", default="", help="where to write it (default: ~/.kube/gpu-train-<cluster>-<team>.yaml)")

    s = sub.add_parser("submit", help="check a job spec, render its JobSet and submit it to your team's queue",
                       description="Read a job spec with the stack's own job checks, render the JobSet with the "
                                   "stack's own renderer for the platform's pool, refuse it when Kueue could never "
                                   "admit it, and create it in the team's namespace.")
    s.add_argument("spec", help="job spec file (YAML)")
    s.add_argument("--dry-run", action="store_true", help="print the JobSet instead of submitting it")
    s.add_argument("--image", default="", help="the job's image (replaces the spec's `image`), pinned by digest, from the platform registry or an allowed one")
    _common(s, team=False)

    ls = sub.add_parser("list", help="your team's jobs and data preparations and their states",
                        description="List the team's jobs (KIND job: JobSets) and data preparations (KIND prepare: "
                                    "RayJobs and Indexed Jobs of `prepare --cluster`): Queued, Running, Paused, Evicted, Completed or "
                                    "Failed.")
    _common(ls)

    for name, text in (("status", "a job's queue position, nodes, step, loss, tokens/s and ETA; a data "
                                  "preparation's queue state and KubeRay's status"),
                       ("pause", "pause a job: Kueue evicts it, it checkpoints, its quota is released"),
                       ("resume", "resume a paused job from its newest checkpoint"),
                       ("cancel", "delete a job (its checkpoints stay in the bucket)")):
        c = sub.add_parser(name, help=text, description=text[0].upper() + text[1:] + ".")
        c.add_argument("job", help="job name")
        _common(c)

    lg = sub.add_parser("logs", help="a rank's log, live from its pod or from the log store once the pod is gone",
                        description="Print one rank's log: from its pod while it exists (live with --follow), else "
                                    "from the platform's log store (CloudWatch Logs on EKS, Cloud Logging on GKE).")
    lg.add_argument("job", help="job name")
    lg.add_argument("--rank", type=int, default=0, help="node rank (the pod index; default 0)")
    lg.add_argument("--follow", "-f", action="store_true", help="keep printing while the pod runs")
    lg.add_argument("--container", default="", help="container (default: trainer)")
    lg.add_argument("--since", default=None, help="from the log store: how far back (30m, 12h, 7d; default 7d)")
    lg.add_argument("--tail", type=int, default=None, help="from a pod: only the last N lines")
    _common(lg)

    li = sub.add_parser("lint", help="check a folder of job specs (jobs/<team>/<name>.yaml) as submit would",
                        description="Check every job spec under DIR (jobs/<team>/<name>.yaml) or one FILE with the "
                                    "checks `submit` runs, plus: the folder is the spec's team, the file name its "
                                    "name, no job twice. Prints each job's carbon estimate.")
    li.add_argument("target", metavar="DIR|FILE", help="a jobs folder, a team folder or one spec file")
    _common(li, team=False)

    ap_ = sub.add_parser("apply", help="make the cluster match a folder of job specs in git",
                         description="Create the JobSets of new specs, leave unchanged ones alone, replace changed "
                                     "ones that hold no running pods (a running one keeps running and is reported), "
                                     "cancel those whose spec was deleted (--prune), and report JobSets edited by "
                                     "hand. Each JobSet carries its spec path, git commit and config hash "
                                     "(docs/gitops.md).")
    ap_.add_argument("dir", metavar="DIR", help="the jobs folder (jobs/<team>/<name>.yaml)")
    ap_.add_argument("--prune", action="store_true", help="cancel applied jobs whose spec file is gone")
    ap_.add_argument("--dry-run", action="store_true", help="print what would change (and each carbon estimate)")
    ap_.add_argument("--replace-running", action="store_true",
                     help="also replace running jobs whose spec changed (they checkpoint, the new spec resumes)")
    ap_.add_argument("--commit", default="", help="the commit to record (default: the checkout's HEAD)")
    _common(ap_, team=False)
    ap_.add_argument("--team", action="append", default=[],
                     help="only this team's folder (repeatable; default: every team folder in DIR)")

    pr = sub.add_parser("prepare", help="prepare a dataset on your team's cluster: a Ray job (or an Indexed Job) in "
                                        "your team's queue",
                        description="Run `python -m trainer.data prepare` in your team's namespace, admitted by Kueue "
                                    "against the team's quota on the CPU nodes (teams[].prepareQuota; it never runs "
                                    "on a GPU pool): on a Ray cluster (--runner ray, default: a KubeRay RayJob, "
                                    "needs the KubeRay operator) or as an Indexed Job of --workers members (--runner "
                                    "job: Kubernetes' own Job controller, no operator; each member runs its share "
                                    "of the tasks, the last to finish merges, a failed member is retried on its "
                                    "index). The same tasks and bytes as on this machine (docs/data.md). Inputs are "
                                    "objects in the datasets bucket; --out is under the bucket's prefix for your "
                                    "team.")
    pr.add_argument("inputs", nargs="*", help="s3:// or gs:// prefixes or objects in the datasets bucket")
    pr.add_argument("--cluster", action="store_true", help="run on the team's cluster (the only mode here; "
                                                           "`python -m trainer.data prepare` runs on this machine)")
    pr.add_argument("--out", default="", help="the dataset's folder: <datasets bucket>/<team>/<name>")
    pr.add_argument("--name", default="", help="the job's name (default: the last part of --out)")
    pr.add_argument("--cancel", metavar="NAME", default="", help="delete this data preparation instead")
    pr.add_argument("--tokenizer", choices=("byte", "bpe", "gpt2"), default="byte",
                    help="byte (default) or bpe (trained on the input); gpt2 needs local files: prepare it here")
    pr.add_argument("--vocab-size", type=int, default=None, help="BPE vocabulary size (with EOT)")
    pr.add_argument("--tasks", type=int, default=None, help="the job's fixed task count (default: from the input)")
    pr.add_argument("--val-fraction", type=float, default=None, help="held-out share (default 0.01)")
    pr.add_argument("--text-field", default="text", help="JSONL field / Parquet column holding the text")
    pr.add_argument("--seed", type=int, default=0, help="fixes the sample a trained BPE learns from")
    pr.add_argument("--include", action="append", default=[], metavar="PATTERN", help="only matching keys")
    pr.add_argument("--exclude", action="append", default=[], metavar="PATTERN", help="skip matching keys")
    pr.add_argument("--force", action="store_true", help="redo it even if --out holds the same dataset")
    pr.add_argument("--runner", choices=("ray", "job"), default="ray",
                    help="ray (default): a KubeRay RayJob, a Ray head driving worker pods (needs the KubeRay "
                         "operator); job: an Indexed Job of --workers member pods sharing one plan, no head and no "
                         "operator (no --force)")
    sizes = {f.name: f.default for f in dataclasses.fields(PrepareRequest)}
    for flag, kind, text in (("workers", int, "Ray worker pods, or the Job's member pods"),
                             ("worker_cpu", int, "CPUs per worker, one task each"),
                             ("worker_memory", str, "memory per worker"),
                             ("head_cpu", int, "CPUs of the Ray head, which runs the driver"),
                             ("head_memory", str, "memory of the Ray head")):
        pr.add_argument("--" + flag.replace("_", "-"), type=kind, default=sizes[flag],
                        help=f"{text} (default {sizes[flag]})")
    pr.add_argument("--tokenizer-file", default="", help=argparse.SUPPRESS)
    pr.add_argument("--dry-run", action="store_true", help="print the RayJob (or Job) instead of submitting it")
    _common(pr)

    rg = sub.add_parser("regions", help="rank the regions offering a GPU machine type by grid carbon intensity",
                        description="Rank the regions where a GPU machine type runs by grid carbon intensity, within "
                                    "the countries, groups (EU, EEA) and regions given, and a latency limit from "
                                    "a home region; sources in docs/carbon.md.")
    rg.add_argument("--pool-type", required=True, help="EC2 instance type or GCE machine type (the catalogs)")
    rg.add_argument("--allow", default="", help="comma-separated country codes, groups (EU, EEA) and region names")
    rg.add_argument("--home", default="", help="a region of the same cloud to estimate latency from")
    rg.add_argument("--max-latency-ms", type=float, default=None, help="leave out regions estimated further away")
    rg.add_argument("--explain", action="store_true", help="say why each other region was left out")

    r = sub.add_parser("run", help="run a job spec on this machine under local torchrun (--local)",
                       description="Run a job spec (default: the embedded tiny preset on CPU) under local torchrun, "
                                   "with the same trainer settings the cluster job gets.")
    r.add_argument("spec", nargs="?", help="job spec file (default: the embedded tiny-preset spec)")
    r.add_argument("--local", action="store_true", required=True, help="run on this machine (the only mode)")
    r.add_argument("--nproc", type=int, default=2, help="local workers (default 2)")
    r.add_argument("--data", default="", help="dataset manifest URI (default: the spec's file:// one, else synthetic)")
    r.add_argument("--runs", default="runs", help="parent of the run directory (default ./runs)")
    r.add_argument("--workdir", default=None,
                   help="where a job of your own code runs (default: the spec file's folder, as the image's "
                        "/workspace holds the folder it was built from)")

    from gpu_train.cli.serve import add_parser as add_serve

    add_serve(sub, _common)
    sweep.register(sub, _common)
    platform.add_parser(sub)
    return ap


def _client(args):
    from gpu_train.client.api import Client

    team = getattr(args, "team", None)
    return Client(kubeconfig=args.kubeconfig, context=args.context, team=team if isinstance(team, str) else None,
                  platform=args.platform)


def _gitops(args) -> int:
    """lint and apply: the contract of each team (from --platform, or the team's namespace), read once."""
    from gpu_train.cli import gitops

    client = _client(args)
    unread = ""
    if args.platform and (args.command == "lint" or args.dry_run):
        # A dry run from a platform file compares with the cluster when a kubeconfig reaches one, else says so.
        try:
            session = None if args.command == "lint" else client.session
        except NoCluster as exc:
            session, unread = None, str(exc)
    else:
        session = client.session  # no kubeconfig: NoCluster, whose message names `gpu-train platform`
    if args.command == "lint":
        return gitops.lint(args.target, client.contract)
    return gitops.apply(session, args.dir, teams=args.team, contracts=client.contract, prune=args.prune,
                        dry_run=args.dry_run, replace_running=args.replace_running, commit=args.commit,
                        unread=unread)


def _prepare(args) -> int:
    """prepare --cluster: the RayJob (or Indexed Job) built, printed (--dry-run) or created; prepare --cancel NAME."""
    import yaml

    from gpu_train.jobs.prepare import PrepareRequest

    client = _client(args)
    if args.cancel:
        client.cancel_prepare(args.cancel)
        print(f"cancelled data preparation {args.cancel!r}")
        return 0
    if not args.cluster:
        raise ClientError("prepare runs on the cluster only (--cluster); on this machine run "
                          "`python -m trainer.data prepare` (docs/data.md)")
    if not args.inputs or not args.out:
        raise ClientError("prepare --cluster needs inputs and --out")
    name = args.name or re.sub(r"[^a-z0-9-]+", "-", args.out.rstrip("/").rsplit("/", 1)[-1].lower()).strip("-")[:32]
    request = PrepareRequest(
        name=name, team=client.team, inputs=tuple(args.inputs), out=args.out, tokenizer=args.tokenizer,
        vocab_size=args.vocab_size, tasks=args.tasks, val_fraction=args.val_fraction, text_field=args.text_field,
        seed=args.seed, include=tuple(args.include), exclude=tuple(args.exclude), force=args.force,
        workers=args.workers, worker_cpu=args.worker_cpu, worker_memory=args.worker_memory, head_cpu=args.head_cpu,
        head_memory=args.head_memory, tokenizer_file=args.tokenizer_file, runner=args.runner)
    obj = client.prepare_cluster(request, dry_run=args.dry_run)
    if args.dry_run:
        print(yaml.safe_dump(obj, sort_keys=False), end="")
        return 0
    meta = obj["metadata"]
    pods = "Ray workers" if request.runner == "ray" else "Indexed Job members"
    print(f"submitted data preparation {meta['name']!r} to {meta['namespace']}, queue "
          f"{meta['labels']['kueue.x-k8s.io/queue-name']} ({request.workers} {pods} x {request.worker_cpu} "
          f"CPUs) -> {request.out}")
    return 0


def run(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command in ("lint", "apply", "submit", "sweep") and not getattr(args, "platform", None):
        try:
            return _run(args)
        except NoCluster as exc:
            raise ClientError(f"{exc}; {PLATFORM_HINT}", code=exc.code) from None
    return _run(args)


def _run(args: argparse.Namespace) -> int:
    cmd = args.command
    if cmd == "platform":
        return platform.platform(args)
    if cmd == "kubeconfig":
        from gpu_train.cli.kubeconfig import write_kubeconfig
        from gpu_train.client.cluster import load_contract

        contract = load_contract(None, args.team, args.platform)
        return write_kubeconfig(contract, args.team, output=args.output, aws_profile=args.aws_profile,
                                role_arn=args.role_arn)
    if cmd == "run":
        from gpu_train.client.local import run_local

        return run_local(args.spec, nproc=args.nproc, data=args.data, runs=args.runs, workdir=args.workdir)
    if cmd == "serve":
        from gpu_train.cli.serve import run_serve

        return run_serve(args)
    if cmd == "sweep":
        return sweep.run(args)
    if cmd == "regions":
        from gpu_train.cli.regions import regions

        return regions(pool_type=args.pool_type, allow=args.allow, home=args.home,
                       max_latency_ms=args.max_latency_ms, explain=args.explain)
    if cmd in ("lint", "apply"):
        return _gitops(args)
    if cmd == "prepare":
        return _prepare(args)
    from gpu_train.cli import show

    if cmd == "submit":
        return show.submitted(_client(args).submit(args.spec, image=args.image, dry_run=args.dry_run))
    client = _client(args)
    if cmd == "list":
        return show.job_list(client.list(), client.team)
    if cmd == "status":
        return show.job_status(client.status(args.job))
    if cmd == "pause":
        return show.paused(args.job, client.pause(args.job))
    if cmd == "resume":
        return show.resumed(args.job, client.resume(args.job))
    if cmd == "cancel":
        client.cancel(args.job)
        return show.cancelled(args.job)
    if cmd == "logs":
        return show.text(client.logs(args.job, rank=args.rank, follow=args.follow, container=args.container,
                                     since=args.since, tail=args.tail))
    raise ClientError(f"unknown command {cmd!r}")


def main(argv: list[str] | None = None) -> int:
    quiet_client_logs()
    try:
        return run(argv)
    except ClientError as exc:
        for line in str(exc).splitlines():
            print(f"{PROG}: error: {line}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `gpu-train logs ... | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
