"""The official ``kubernetes`` client, as the daemon uses it: its ``client`` and ``config``
modules and the watch stream's line reader, imported without the package's ``__init__``, and
its requests made without the generated API classes (:func:`request`, :class:`Collection`), and
only the configuration loader the agent needs (:func:`load_configuration`).

``kubernetes/__init__.py`` imports every part of the package (``dynamic``, ``stream``,
``utils``, ``leaderelection``, ``informer``, ``watch``), which the daemon does not use; they are a
quarter of the agent's import time (``python -X importtime``: about 0.2-0.4 s of 1-1.5 s here),
and a DaemonSet rollout restarts every agent. When nothing has imported ``kubernetes`` yet, this
module puts a bare package object for it in ``sys.modules`` (the same ``__path__``, so any
submodule still imports as usual: a later ``import kubernetes.stream`` works); when something
has, the package is used as it is.

The generated API classes (``CoreV1Api``, ``NetworkingV1Api``, ...) are not used: their modules
import the typed models of every object they name (``CoreV1Api`` alone makes 284 pydantic
model classes: 0.9-2.6 s of an agent's start here, more than the rest of its imports), and the
daemon reads JSON itself. :func:`request` makes the request their methods make (the same path,
query parameters, ``Accept`` and authentication, through the same ``ApiClient``), and raises
``ApiException`` on the same answers.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
from typing import Any, Callable, Mapping


def _bare_package(name: str) -> None:
    """Package ``name`` without its ``__init__``: a look-up of a submodule imports it (as
    ``from kubernetes import client`` does), the first look-up of anything else runs the
    ``__init__`` then (PEP 562), so that code that uses the package whole later
    (``config.load_kube_config``) still finds what it expects."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations or spec.loader is None:
        return  # not installed: the imports below say so
    package = importlib.util.module_from_spec(importlib.machinery.ModuleSpec(name, None, is_package=True))
    package.__path__ = list(spec.submodule_search_locations)
    loader = spec.loader

    def complete(attribute: str) -> Any:
        if not attribute.startswith("__") and importlib.util.find_spec(f"{name}.{attribute}") is not None:
            return importlib.import_module(f"{name}.{attribute}")
        del package.__getattr__
        loader.exec_module(package)
        return getattr(package, attribute)

    package.__getattr__ = complete  # type: ignore[method-assign]
    sys.modules[name] = package


_bare_package("kubernetes")
# kubernetes.config's __init__ imports the kubeconfig loader (with oauthlib, requests and the
# auth providers: 17 MiB and about 0.1 s here), which an agent in its pod never uses.
_bare_package("kubernetes.config")

from kubernetes import client  # noqa: E402
from kubernetes.config.config_exception import ConfigException  # noqa: E402
from kubernetes.watch.watch import iter_resp_lines  # noqa: E402

__all__ = ["Collection", "ConfigException", "client", "iter_resp_lines", "load_configuration", "request"]


def load_configuration(kubeconfig: str | None, configuration: client.Configuration) -> None:
    """Fill ``configuration`` from the kubeconfig file ``kubeconfig``, or (None) from the pod's
    service account (in-cluster), importing only the loader it needs. Raises ConfigException
    (and what the kubeconfig loader raises for a file it cannot read)."""
    if kubeconfig:
        from kubernetes.config.kube_config import load_kube_config

        load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    else:
        from kubernetes.config.incluster_config import load_incluster_config

        load_incluster_config(client_configuration=configuration)


def query_name(keyword: str) -> str:
    """The API's name of a query parameter given as the generated methods' keyword:
    ``allow_watch_bookmarks`` -> ``allowWatchBookmarks``, ``_continue`` -> ``continue``."""
    first, *rest = keyword.lstrip("_").split("_")
    return first + "".join(word.capitalize() for word in rest)


def request(api: client.ApiClient, method: str, path: str, timeout: Any, query: Mapping[str, Any] | None = None,
            body: Any = None, content_type: str | None = None, accept: str = "application/json",
            error_body: Callable[[bytes], str | None] | None = None) -> Any:
    """``method`` on ``path`` (``/api/v1/pods``) through ``api`` (its configuration: server,
    TLS, credentials, default headers), with ``query`` (the generated methods' keywords, None
    values left out, in their order: the API's names sorted), ``body`` (sent as JSON, with
    ``content_type`` if given, else the client's ``application/json``), ``accept`` (the
    ``Accept`` header) and ``timeout`` (seconds, or a (connect, read)
    pair). Returns the urllib3 response, its body unread (read it, or stream it and
    ``release_conn()``). Raises ``ApiException`` for an answer outside 2xx (its status, reason,
    headers and body: ``error_body``'s text of it when that gives one, e.g. a protobuf Status as
    JSON), and with status 0 when there is no answer, as the generated methods do."""
    headers = {"Accept": accept}
    if content_type is not None:
        headers["Content-Type"] = content_type
    params = sorted((query_name(k), v) for k, v in (query or {}).items() if v is not None)
    serialized = api.param_serialize(method, path, query_params=params, header_params=headers, body=body,
                                     auth_settings=["BearerToken"])
    response = api.call_api(*serialized, _request_timeout=timeout)
    if not 200 <= response.status <= 299:
        data = response.read()
        text = error_body(data) if error_body is not None and data else None
        raise client.ApiException.from_response(http_resp=response, body=text, data=None)
    return response.response


class Collection:
    """GET on one API collection (``path``, e.g. ``/api/v1/pods``): a list, or a watch with
    ``watch=True``. Called as the generated ``list_*`` methods are with ``_preload_content=False``
    (query parameters as their keywords: ``limit``, ``_continue``, ``watch``,
    ``resource_version``, ...; ``_request_timeout``), it returns the unread urllib3 response
    (:func:`request`), asking for ``accept`` (an error's body read by ``error_body``)."""

    def __init__(self, api: client.ApiClient, path: str, accept: str = "application/json",
                 error_body: Callable[[bytes], str | None] | None = None) -> None:
        self.api, self.path, self.accept, self.error_body = api, path, accept, error_body

    def __repr__(self) -> str:
        return f"Collection({self.path}, {self.accept})"

    def __call__(self, _request_timeout: Any = None, **query: Any) -> Any:
        return request(self.api, "GET", self.path, _request_timeout, query, accept=self.accept, error_body=self.error_body)
