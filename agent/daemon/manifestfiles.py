"""Reading manifest files and directories (the file-system side of the manifests source)."""

from __future__ import annotations

import codecs
import sys
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator, TextIO

from nftpolicy.translators.manifests import ManifestError, NotStreamable, build_cluster, json_list_objects, parse_documents
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
    per file that cannot be read (permissions, an I/O error) or is not UTF-8 and per document that
    does not parse (the rest is still returned)."""
    objects, errors = [], []
    for name in manifest_files(paths):
        try:  # a file's bytes as they are: JSON needs no decoded copy
            docs, errs = parse_documents(stdin.read() if name == "-" else Path(name).read_bytes(), "<stdin>" if name == "-" else name)
        except UnicodeDecodeError as exc:
            errors.append(ManifestError("file", name, f"not UTF-8 text: {exc.reason} at byte {exc.start}"))
            continue
        except OSError as exc:
            errors.append(unreadable(name, exc))
            continue
        objects.extend(docs)
        errors.extend(errs)
    return objects, errors


def unreadable(name: str, exc: OSError) -> ManifestError:
    """The error of a file the system refuses to read: its name and the system's reason
    (``cannot read: Permission denied``); the file is left out like one that does not parse."""
    return ManifestError("file", name, f"cannot read: {exc.strerror or exc}")


CHUNK = 1 << 20  # bytes read at a time from a JSON file read item by item


def read_once(paths: Iterable[str]) -> bool:
    """True when a manifest under ``paths`` can be read only once: stdin (``-``) or anything that
    is not a regular file (a pipe such as ``<(kubectl get pods -A -o json)``, a FIFO). Raises
    FileNotFoundError as :func:`manifest_files` does."""
    return any(name == "-" or not Path(name).is_file() for name in manifest_files(paths))


def stream_objects(paths: Iterable[str], errors: list[ManifestError]) -> Iterator[tuple[str, Any]]:
    """:func:`read_objects`, one object at a time: a regular file that starts with ``{`` (one JSON
    object: a List as ``kubectl get -o json`` prints it) is read in chunks of :data:`CHUNK` bytes
    and its items parsed one by one (:func:`~nftpolicy.translators.manifests.json_list_objects`),
    so that a consumer that keeps only what it makes of each object holds one item's dict at a
    time; other files are read whole, as are stdin and pipes (:func:`read_once`: a pipe's first
    chunk, once read to look at, could not be read again). ``errors`` gets what
    :func:`read_objects` returns.

    Raises :class:`~nftpolicy.translators.manifests.NotStreamable` when a file read item by item
    would read otherwise whole (not valid JSON, or not a List): the caller drops what it made and
    calls :func:`read_objects`, which it can only when no path is :func:`read_once`."""
    for name in manifest_files(paths):
        if not read_once([name]):
            try:
                with open(name, "rb") as file:
                    if file.read(CHUNK).lstrip()[:1] == b"{":  # whitespace longer than a chunk: read whole
                        file.seek(0)
                        yield from json_list_objects(_decoded_chunks(file), name, errors)
                        continue
            except OSError as exc:
                errors.append(unreadable(name, exc))
                continue
        objects, errs = read_objects([name])
        yield from objects
        errors.extend(errs)


def _decoded_chunks(file: BinaryIO) -> Iterator[str]:
    """The UTF-8 text of ``file`` in chunks of :data:`CHUNK` bytes. A byte that is not UTF-8
    raises NotStreamable (the whole read reports it with its position)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    while True:
        data = file.read(CHUNK)
        try:
            text = decoder.decode(data, final=not data)
        except UnicodeDecodeError as exc:
            raise NotStreamable(f"not UTF-8 text: {exc.reason}") from None
        if text:
            yield text
        if not data:
            return


def load_cluster(paths: Iterable[str], stdin: TextIO = sys.stdin) -> tuple[Cluster, list[ManifestError]]:
    """Read every manifest under ``paths`` into one :class:`Cluster`; returns it and the errors of
    the objects (or files) left out."""
    objects, errors = read_objects(paths, stdin)
    cluster, invalid = build_cluster(objects)
    return cluster, errors + invalid
