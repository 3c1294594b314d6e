"""The Kubernetes API as ``kubectl nftpolicy`` uses it: the user's kubeconfig and context, the
user's own RBAC, and every refusal as one line naming the verb and the resource.

Each request names its verb and resource (:meth:`Api.call`), so that a 403 becomes
``cannot list clusternetworkpolicies (forbidden): ask for list on clusternetworkpolicies.policy.networking.k8s.io
(cluster-wide)`` (:class:`Forbidden`), and an API server that does not answer becomes
``cannot reach the API server at https://...: <reason>`` (:class:`Unreachable`). Objects are
the API's JSON as it is (camelCase, as in manifests), with ``kind`` and ``apiVersion`` set on
every listed item (a list's items lack them).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

import orjson
import urllib3
import yaml
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from nftpolicy.translators.errors import OneLineError

LIST_PAGE = 500  # objects per list request, as kubectl and client-go page
REQUEST_TIMEOUT = 30.0  # seconds of one request, unless --request-timeout says otherwise


class PluginError(OneLineError, RuntimeError):
    """Anything that ends ``kubectl nftpolicy`` with one line and exit 2."""


class Forbidden(PluginError):
    """The user's RBAC lacks ``verb`` on ``resource``: the message says what to ask for."""


class Unreachable(PluginError):
    """The API server did not answer (connection refused, TLS, timeout)."""


@dataclass(frozen=True)
class Resource:
    """A resource as RBAC names it: ``plural`` in API ``group`` (``""``: core), and the
    namespace of the request (``None``: cluster-wide, or every namespace)."""

    plural: str
    group: str = ""
    namespace: str | None = None

    @property
    def rbac(self) -> str:
        """``plural.group`` (``plural`` for the core group), as ``kubectl auth can-i`` takes it."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def scope(self) -> str:
        """``in namespace NS`` or ``cluster-wide``."""
        return f"in namespace {self.namespace}" if self.namespace else "cluster-wide"


PODS, NAMESPACES, NODES, SERVICES = Resource("pods"), Resource("namespaces"), Resource("nodes"), Resource("services")
NETWORK_POLICIES = Resource("networkpolicies", "networking.k8s.io")
CLUSTER_NETWORK_POLICIES = Resource("clusternetworkpolicies", "policy.networking.k8s.io")


def in_namespace(resource: Resource, namespace: str | None) -> Resource:
    """``resource`` as requested in ``namespace`` (None: every namespace)."""
    return Resource(resource.plural, resource.group, namespace)


class Api:
    """A client of the API server of the kubeconfig's ``context`` (the current one when None).
    Raises PluginError when the kubeconfig cannot be read or has no such context."""

    def __init__(self, kubeconfig: str | None, context: str | None, timeout: float = REQUEST_TIMEOUT) -> None:
        configuration = k8s.Configuration()
        source = kubeconfig or os.environ.get("KUBECONFIG") or "~/.kube/config"  # kubectl's order
        if not any(os.path.exists(os.path.expanduser(path)) for path in source.split(os.pathsep) if path):
            raise PluginError(f"cannot use the kubeconfig {source}: no such file"
                              f"{'' if kubeconfig else ' (--kubeconfig, $KUBECONFIG, else ~/.kube/config)'}")
        try:
            k8s_config.load_kube_config(config_file=kubeconfig, context=context, client_configuration=configuration)
        except (k8s_config.ConfigException, yaml.YAMLError, UnicodeDecodeError, OSError, TypeError, ValueError) as exc:
            reason = " ".join(str(exc).split())
            raise PluginError(f"cannot use the kubeconfig {source}: {reason}") from None
        configuration.retries = False
        self.configuration = configuration
        self.server: str = configuration.host
        self.timeout = timeout
        self.client = k8s.ApiClient(configuration)
        self.core = k8s.CoreV1Api(self.client)

    def fresh(self) -> "Api":
        """Another client of the same API server and user (the websocket of an exec patches its
        client while it runs: one client per thread)."""
        other = object.__new__(Api)
        other.configuration, other.server, other.timeout = self.configuration, self.server, self.timeout
        other.client = k8s.ApiClient(self.configuration)
        other.core = k8s.CoreV1Api(other.client)
        return other

    def call(self, verb: str, resource: Resource, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``function(*args, **kwargs)`` with the request timeout; a refusal as one line: 401,
        403 (:class:`Forbidden`, naming ``verb`` on ``resource``), no answer
        (:class:`Unreachable`). Any other HTTP error is raised as it is (k8s.ApiException) for
        the caller to judge (:func:`failed`)."""
        try:
            return function(*args, _request_timeout=self.timeout, **kwargs)
        except k8s.ApiException as exc:
            if exc.status == 403:
                raise Forbidden(f"cannot {verb} {resource.plural} (forbidden): ask for {verb} on {resource.rbac} {resource.scope}") from None
            if exc.status == 401:
                raise PluginError(f"the API server at {self.server} refused the kubeconfig's credentials "
                                  f"(401 Unauthorized): {status_message(exc)}") from None
            raise
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise Unreachable(f"cannot reach the API server at {self.server}: {_reason(exc)}") from None

    def list_all(self, resource: Resource, kind: str, api_version: str, function: Callable[..., Any],
             missing_ok: bool = False, **kwargs: Any) -> list[dict[str, Any]]:
        """Every object of a list call (all pages), as API JSON with ``kind`` and ``apiVersion``
        set; ``missing_ok``: a 404 (a CRD that is not installed) is no object. Raises PluginError."""
        items: list[dict[str, Any]] = []
        token = None
        while True:
            try:
                response = self.call("list", resource, function, limit=LIST_PAGE, _continue=token, _preload_content=False, **kwargs)
            except k8s.ApiException as exc:
                if exc.status == 404 and missing_ok:
                    return []
                raise failed("list", resource, exc) from None
            body = orjson.loads(response.data)
            items.extend({"kind": kind, "apiVersion": api_version, **item} for item in body.get("items") or ())
            token = (body.get("metadata") or {}).get("continue")
            if not token:
                return items

    def pods(self, namespace: str | None, label_selector: str, field_selector: str = "") -> list[dict[str, Any]]:
        """The pods of ``namespace`` (None: of every namespace) that the selectors select.
        Raises PluginError."""
        resource = in_namespace(PODS, namespace)
        if namespace:
            return self.list_all(resource, "Pod", "v1", self.core.list_namespaced_pod, namespace=namespace,
                             label_selector=label_selector, field_selector=field_selector)
        return self.list_all(resource, "Pod", "v1", self.core.list_pod_for_all_namespaces,
                         label_selector=label_selector, field_selector=field_selector)

    def get(self, resource: Resource, kind: str, api_version: str, function: Callable[..., Any], *args: Any) -> dict[str, Any] | None:
        """One object as API JSON, or None when it does not exist. Raises PluginError."""
        try:
            response = self.call("get", resource, function, *args, _preload_content=False)
        except k8s.ApiException as exc:
            if exc.status == 404:
                return None
            raise failed("get", resource, exc) from None
        obj: dict[str, Any] = {"kind": kind, "apiVersion": api_version, **orjson.loads(response.data)}
        return obj

    def proxy_get(self, namespace: str, pod: str, port: int, path: str, https: bool = False) -> tuple[int, str]:
        """GET ``path`` of ``pod``'s ``port`` through the API server's pod proxy, over TLS with
        ``https`` (the API server does not check the pod's certificate): (HTTP status, body
        text). An error status is the pod's own answer (``/readyz``'s 503 and its reasons) or
        the API server's, which could not reach the pod (its Status message). Raises Forbidden
        (get on pods/proxy), Unreachable."""
        try:
            response = self.call("get", Resource("pods/proxy", "", namespace), self.core.connect_get_namespaced_pod_proxy_with_path,
                                 f"{'https:' if https else ''}{pod}:{port}", namespace, path, _preload_content=False)
            return int(response.status), response.data.decode(errors="replace")
        except k8s.ApiException as exc:
            return int(exc.status or 0), status_message(exc)


def failed(verb: str, resource: Resource, exc: k8s.ApiException) -> PluginError:
    """An HTTP error of ``verb`` on ``resource`` as one line: its status and the API's message."""
    return PluginError(f"cannot {verb} {resource.plural}: {exc.status} {status_message(exc)}")


def status_message(exc: k8s.ApiException) -> str:
    """The message of the API's Status in ``exc``'s body, else the body's text, else the reason."""
    body = exc.body.decode(errors="replace") if isinstance(exc.body, bytes) else str(exc.body or "")
    try:
        return " ".join(str(orjson.loads(body).get("message") or body or exc.reason).split())
    except (orjson.JSONDecodeError, AttributeError):
        return body.strip() or str(exc.reason)


def _reason(exc: BaseException) -> str:
    """The innermost reason of a urllib3 error, on one line."""
    reason = getattr(exc, "reason", None) or exc
    return " ".join(str(reason).split())
