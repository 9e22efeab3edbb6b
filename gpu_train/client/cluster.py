"""The cluster as a team member reaches it: their kubeconfig, their team's namespace, the platform contract,
and API errors turned into one line that says what to do.

Usage (gpu_train.client.Client does this):
    session = connect(kubeconfig=args.kubeconfig, context=args.context)
    team = resolve_team(args.team, session)
    contract = load_contract(session, team, platform_file=args.platform)
    try: ... except ApiException as exc: raise api_error(exc, doing="create jobsets", namespace=ns) from None

Everything goes through the official `kubernetes` client with the kubeconfig's own authentication (the
cloud CLI's exec plugin): nothing here holds or asks for a credential.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client as k8s_client
from kubernetes import config as k8s_config
from kubernetes.client.rest import ApiException
from kubernetes.config.config_exception import ConfigException

from gpu_train.client.errors import PLUGIN_ERRORS, ClientError, NoCluster
from gpu_train.spec import naming

DOCS = "docs/teams.md"
ANONYMOUS = "system:anonymous"
# The RBAC authorizer's refusal (k8s.io/apiserver/pkg/endpoints/handlers/responsewriters: forbiddenMessage).
RBAC_DENIAL = re.compile(r'User "[^"]*" cannot ')


@dataclass
class Session:
    kubeconfig: Path
    context: str
    namespace: str  # the context's namespace ("" when it sets none)
    server: str
    api: k8s_client.ApiClient

    @property
    def core(self) -> k8s_client.CoreV1Api:
        return k8s_client.CoreV1Api(self.api)

    @property
    def custom(self) -> k8s_client.CustomObjectsApi:
        return k8s_client.CustomObjectsApi(self.api)


def kubeconfig_path(explicit: str | None) -> Path:
    """--kubeconfig, else the first file of $KUBECONFIG, else ~/.kube/config; a clear error when none exists."""
    if explicit:
        path = Path(explicit).expanduser()
        if not path.is_file():
            raise ClientError(f"--kubeconfig {explicit}: no such file")
        return path
    env = os.environ.get("KUBECONFIG", "")
    for entry in (e for e in env.split(os.pathsep) if e):
        if Path(entry).expanduser().is_file():
            return Path(entry).expanduser()
    default = Path.home() / ".kube" / "config"
    if default.is_file():
        return default
    where = f"KUBECONFIG={env} names no existing file" if env else f"{default} does not exist and KUBECONFIG is not set"
    raise NoCluster(f"no kubeconfig: {where}. Get one for your team with `gpu-train kubeconfig --platform "
                    f"platform.json --team <team>` ({DOCS})")


def connect(kubeconfig: str | None = None, context: str | None = None) -> Session:
    path = kubeconfig_path(kubeconfig)
    try:
        contexts, current = k8s_config.list_kube_config_contexts(config_file=str(path))
    except ConfigException as exc:
        raise ClientError(f"{path}: not a usable kubeconfig: {exc}") from None
    chosen = next((c for c in contexts if c["name"] == context), None) if context else current
    if context and chosen is None:
        raise ClientError(f"{path}: no context named {context!r} (contexts: {', '.join(c['name'] for c in contexts)})")
    if not chosen:
        raise ClientError(f"{path}: no current context; name one with --context")
    try:
        api = k8s_config.new_client_from_config(config_file=str(path), context=chosen["name"])
    except ConfigException as exc:
        raise ClientError(f"{path}: context {chosen['name']!r} cannot be used: {exc}") from None
    return Session(kubeconfig=path, context=chosen["name"], namespace=str(chosen["context"].get("namespace") or ""),
                   server=api.configuration.host, api=api)


def team_namespace(team: str) -> str:
    return naming.team_namespace(team)


def resolve_team(explicit: str | None, session: Session | None) -> str:
    """--team, else the team whose namespace the kubeconfig context points at."""
    if explicit:
        return explicit
    prefix = team_namespace("")
    if session is not None and session.namespace.startswith(prefix) and len(session.namespace) > len(prefix):
        return session.namespace[len(prefix):]
    where = f"context {session.context!r} has namespace {session.namespace!r}" if session and session.namespace \
        else "the kubeconfig context sets no team namespace"
    raise ClientError(f"which team? {where}; pass --team <team>, or use a kubeconfig from `gpu-train kubeconfig "
                   f"--team <team>`, whose context namespace is the team's")


def _status_message(exc: ApiException) -> str:
    try:
        body = json.loads(exc.body or "{}")
    except (TypeError, ValueError):
        return str(exc.reason or "").strip()
    return str(body.get("message") or exc.reason or "").strip() if isinstance(body, dict) else str(exc.reason)


def _unreachable(exc: Exception) -> str:
    text = str(getattr(exc, "reason", None) or exc)
    m = re.search(r"\[Errno -?\d+\] [^\"')]+", text)
    return m.group(0).strip() if m else (text.splitlines()[0] if text else type(exc).__name__)


def api_error(exc: Exception, *, doing: str, namespace: str = "", team: str = "", server: str = "") -> ClientError:
    """An API failure as one line that says what to do. `doing`: e.g. "create jobsets"."""
    if not isinstance(exc, ApiException):
        return ClientError(f"cannot reach the Kubernetes API server{f' at {server}' if server else ''} to {doing}: "
                        f"{_unreachable(exc)}", code=1)
    message = _status_message(exc)
    where = f" in namespace {namespace}" if namespace else ""
    # With no credential at all (the exec plugin failed and the client went on without a token) the API server
    # takes the request as system:anonymous and RBAC answers 403, not 401: kube-apiserver's --anonymous-auth
    # defaults to true (https://kubernetes.io/docs/reference/access-authn-authz/authentication/#anonymous-requests).
    anonymous = exc.status == 403 and f'User "{ANONYMOUS}"' in message
    if exc.status == 401 or anonymous:
        plugin = f" (the kubeconfig's credential command failed: {PLUGIN_ERRORS.messages[-1]})" \
            if PLUGIN_ERRORS.messages else ""
        answer = "401 Unauthorized" if exc.status == 401 else f"403 Forbidden to {ANONYMOUS}: no credential was sent"
        return ClientError(f"the API server did not accept your credentials ({answer}) to {doing}{where}{plugin}: "
                        "sign in again (aws sso login / gcloud auth login) and check that your kubeconfig's user runs "
                        f"the cloud CLI ({DOCS})", code=1)
    if exc.status == 403 and not RBAC_DENIAL.search(message):
        # Not RBAC but admission: the team namespaces' ValidatingAdmissionPolicies deny with reason Forbidden
        # (infra/k8s/pod_admission.py), which the API server answers with 403 and the policy's message.
        return ClientError(f"the cluster refused to {doing}{where} (403 Forbidden): {message}", code=2)
    if exc.status == 403:
        who = f"team {team!r}" if team else "this team"
        return ClientError(f"you may not {doing}{where} (403 Forbidden: {message}): you are not a member of {who}, or "
                        f"your role there is viewer; ask the platform administrators to add you ({DOCS})", code=1)
    if exc.status == 404:
        return ClientError(f"not found (404) while trying to {doing}{where}: {message}", code=1)
    if exc.status == 409:
        return ClientError(f"conflict (409) while trying to {doing}{where}: {message}", code=1)
    if exc.status == 422:
        return ClientError(f"the cluster refused to {doing}{where} (422 Invalid): {message}", code=2)
    return ClientError(f"the API server answered {exc.status} {exc.reason} to {doing}{where}: {message}", code=1)


def load_contract(session: Session | None, team: str, platform_file: str | None = None):
    """The platform contract: the file given with --platform, or the team namespace's ConfigMap."""
    from gpu_train.spec.contract import ContractError, PlatformContract

    try:
        if platform_file:
            path = Path(platform_file).expanduser()
            if not path.is_file():
                raise ClientError(f"--platform {platform_file}: no such file")
            return PlatformContract.from_json(path.read_text(), str(path))
        if session is None:
            raise NoCluster("no cluster to read the platform contract from: pass --platform FILE")
        ns = team_namespace(team)
        try:
            cm = session.core.read_namespaced_config_map(naming.PLATFORM_CONFIGMAP, ns)
        except ApiException as exc:
            if exc.status == 404:
                raise ClientError(f"no platform contract in namespace {ns} (ConfigMap {naming.PLATFORM_CONFIGMAP}): team "
                               f"{team!r} is not on this cluster, or the kubeconfig points at another cluster "
                               f"({session.server})", code=2) from None
            raise api_error(exc, doing=f"read the platform contract (configmap {naming.PLATFORM_CONFIGMAP})",
                            namespace=ns, team=team, server=session.server) from None
        except Exception as exc:  # urllib3 connection errors, exec plugin failures
            raise api_error(exc, doing="read the platform contract", server=session.server) from None
        text = (cm.data or {}).get(naming.PLATFORM_CONFIGMAP_KEY)
        if not text:
            raise ClientError(f"configmap {ns}/{naming.PLATFORM_CONFIGMAP} has no {naming.PLATFORM_CONFIGMAP_KEY}",
                           code=1)
        return PlatformContract.from_json(text, f"configmap {ns}/{naming.PLATFORM_CONFIGMAP}")
    except ContractError as exc:
        raise ClientError(str(exc)) from None


def call(session: Session, fn, *args: Any, doing: str, namespace: str = "", team: str = "", **kwargs: Any) -> Any:
    """Run one API call; any failure becomes a ClientError naming what was being done."""
    try:
        return fn(*args, **kwargs)
    except ClientError:
        raise
    except Exception as exc:  # ApiException, urllib3 errors, exec plugin failures
        raise api_error(exc, doing=doing, namespace=namespace, team=team, server=session.server) from None
