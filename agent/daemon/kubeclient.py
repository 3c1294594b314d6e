"""The official ``kubernetes`` client, as the daemon uses it: its ``client`` and ``config``
modules and the watch stream's line reader, imported without the package's ``__init__``, and
its requests made without the generated API classes (:func:`request`, :class:`Collection`).

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


def _bare_package() -> None:
    if "kubernetes" in sys.modules:
        return
    spec = importlib.util.find_spec("kubernetes")
    if spec is None or not spec.submodule_search_locations:
        return  # not installed: the imports below say so
    package = importlib.util.module_from_spec(importlib.machinery.ModuleSpec("kubernetes", None, is_package=True))
    package.__path__ = list(spec.submodule_search_locations)
    sys.modules["kubernetes"] = package


_bare_package()

from kubernetes import client, config  # noqa: E402
from kubernetes.watch.watch import iter_resp_lines  # noqa: E402

__all__ = ["Collection", "client", "config", "iter_resp_lines", "request"]


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
