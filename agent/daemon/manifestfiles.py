"""Reading manifest files and directories (the file-system side of the manifests source)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterable, TextIO

from nftpolicy.translators.manifests import ManifestError, build_cluster, parse_documents
from nftpolicy.translators.model import Cluster

SUFFIXES = (".yaml", ".yml", ".json")


def manifest_files(paths: Iterable[str]) -> list[str]:
    """Expand directories (recursively, ``*.yaml|*.yml|*.json``, sorted); ``-`` stays as stdin.

    Raises FileNotFoundError for a path that does not exist.
    """
    files: list[str] = []
    for path in paths:
        if path == "-":
            files.append(path)
            continue
        p = Path(path)
        if p.is_dir():
            files.extend(str(f) for f in sorted(p.rglob("*")) if f.is_file() and f.suffix in SUFFIXES)
        elif p.exists():
            files.append(path)
        else:
            raise FileNotFoundError(f"no such file or directory: {path}")
    return files


def read_objects(paths: Iterable[str], stdin: TextIO = sys.stdin) -> tuple[list[tuple[str, Any]], list[ManifestError]]:
    """Every object in the manifests under ``paths`` as ``(origin, object)`` pairs, and one error
    per file that is not UTF-8 or document that does not parse (the rest is still returned)."""
    objects, errors = [], []
    for name in manifest_files(paths):
        try:  # a file's bytes as they are: JSON needs no decoded copy
            docs, errs = parse_documents(stdin.read() if name == "-" else Path(name).read_bytes(), "<stdin>" if name == "-" else name)
        except UnicodeDecodeError as exc:
            errors.append(ManifestError("file", name, f"not UTF-8 text: {exc.reason} at byte {exc.start}"))
            continue
        objects.extend(docs)
        errors.extend(errs)
    return objects, errors


def load_cluster(paths: Iterable[str], stdin: TextIO = sys.stdin) -> tuple[Cluster, list[ManifestError]]:
    """Read every manifest under ``paths`` into one :class:`Cluster`; returns it and the errors of
    the objects (or files) left out."""
    objects, errors = read_objects(paths, stdin)
    cluster, invalid = build_cluster(objects)
    return cluster, errors + invalid
