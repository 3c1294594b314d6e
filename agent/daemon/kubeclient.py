"""The official ``kubernetes`` client, as the daemon uses it: its ``client`` and ``config``
modules and the watch stream's line reader, imported without the package's ``__init__``.

``kubernetes/__init__.py`` imports every part of the package (``dynamic``, ``stream``,
``utils``, ``leaderelection``, ``informer``, ``watch``), which the daemon does not use; they are a
quarter of the agent's import time (``python -X importtime``: about 0.2-0.4 s of 1-1.5 s here),
and a DaemonSet rollout restarts every agent. When nothing has imported ``kubernetes`` yet, this
module puts a bare package object for it in ``sys.modules`` (the same ``__path__``, so any
submodule still imports as usual: a later ``import kubernetes.stream`` works); when something
has, the package is used as it is.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys


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

__all__ = ["client", "config", "iter_resp_lines"]
