"""The build step of nftpolicy's protobuf decoder (everything else is in pyproject.toml).

``build_py`` (run by ``pip install .``, ``pip install -e .`` and a wheel build) first generates
``agent/daemon/k8s_pb2.py`` and its ``.pyi``: the messages and fields of
``agent/daemon/kubefields.py``, cut out of the Kubernetes API's own ``generated.proto`` files
(``k8s.io/api`` and ``k8s.io/apimachinery`` at the versions ``tools/k8s/go.mod`` pins), with
protoc from grpcio-tools (a build requirement). The ``.proto`` files are found at
``$NFTPOLICY_K8S_PROTO`` (a directory laid out by import path: ``k8s.io/api/core/v1/generated.proto``,
``k8s.io/apimachinery/...``; the Containerfile's ``protos`` stage makes one), else in the Go
module cache through ``go list -m`` in ``tools/k8s`` (after ``bash .ci/install --test``). Found
neither way, or without grpcio-tools, the build says so in one line and goes on without them:
the agent then lists and watches in JSON (it logs that once at its start).

``python setup.py k8s_proto`` runs the generation alone (``.ci/install`` does, once Go is there).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from setuptools import Command, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "agent" / "daemon"
GENERATED = ("k8s_pb2.py", "k8s_pb2.pyi")
PACKAGE = "nftpolicy.k8s"  # the generated messages' protobuf package (the wire knows only numbers)


def _fields() -> Any:
    spec = importlib.util.spec_from_file_location("_kubefields", OUT / "kubefields.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _proto_root(work: Path) -> Path | None:
    """A directory with the pinned modules' ``.proto`` files by import path, or None."""
    given = os.environ.get("NFTPOLICY_K8S_PROTO")
    if given:
        return Path(given)
    go = shutil.which("go") or ("/usr/local/go/bin/go" if os.access("/usr/local/go/bin/go", os.X_OK) else None)
    if go is None or not (ROOT / "tools" / "k8s" / "go.mod").exists():
        return None
    done = subprocess.run([go, "list", "-m", "-json", "k8s.io/api", "k8s.io/apimachinery"], cwd=ROOT / "tools" / "k8s",
                          capture_output=True, text=True, env={**os.environ, "GOFLAGS": "-mod=mod"})
    if done.returncode != 0:
        return None
    decoder, text, dirs = json.JSONDecoder(), done.stdout.strip(), {}
    while text:
        module, end = decoder.raw_decode(text)
        dirs[module["Path"]] = module.get("Dir")
        text = text[end:].strip()
    if not all(dirs.get(m) for m in ("k8s.io/api", "k8s.io/apimachinery")):
        return None
    root = work / "proto"
    (root / "k8s.io").mkdir(parents=True)
    for module, directory in dirs.items():
        (root / module).symlink_to(directory)
    return root


def _protoc(*args: str) -> None:
    from grpc_tools import protoc  # type: ignore[import-untyped]

    include = Path(protoc.__file__).parent / "_proto"
    if protoc.main(["protoc", f"-I{include}", *args]) != 0:
        raise RuntimeError(f"protoc {' '.join(args)} failed")


def _cut(full: Any, fields: Any) -> Any:
    """The one FileDescriptorProto of :data:`fields.MESSAGES` out of ``full`` (a FileDescriptorSet)."""
    from google.protobuf import descriptor_pb2

    upstream: dict[str, Any] = {}

    def index(prefix: str, messages: Any) -> None:
        for message in messages:
            upstream[f"{prefix}.{message.name}"] = message
            index(f"{prefix}.{message.name}", message.nested_type)

    for file in full.file:
        index(file.package, file.message_type)
    out = descriptor_pb2.FileDescriptorProto(name="k8s.proto", package=PACKAGE, syntax="proto2")
    made: dict[Any, str] = {}  # id(entry), or an upstream name kept whole -> its generated message's name

    def make(name: str, entry: Any) -> str:
        source_name, keep = entry
        memo = source_name if keep == fields.ALL else id(entry)
        if memo in made:
            return made[memo]
        if keep == fields.ALL:  # kept whole: the upstream name (kubeproto reads it as that)
            name = source_name.rpartition(".")[2]
        source = upstream[source_name]
        made[memo] = name
        message = out.message_type.add(name=name)
        wanted = [f.name for f in source.field] if keep == fields.ALL else list(keep)
        for field_name in wanted:
            field = next((f for f in source.field if f.name == field_name), None)
            if field is None:
                raise RuntimeError(f"{source_name} has no field {field_name} in the pinned generated.proto")
            copy = message.field.add()
            copy.CopyFrom(field)
            if field.type != field.TYPE_MESSAGE:
                continue
            target = field.type_name.lstrip(".")
            entry_type = upstream[target]
            if entry_type.options.map_entry:  # map<k, v>: its entry type goes along, nested
                message.nested_type.add().CopyFrom(entry_type)
                copy.type_name = f".{PACKAGE}.{name}.{entry_type.name}"
            else:
                sub = (target, fields.ALL) if keep == fields.ALL else keep[field_name]
                if sub is None or sub[0] != target:
                    raise RuntimeError(f"{source_name}.{field_name} is a {target}: say which of its fields to keep")
                copy.type_name = f".{PACKAGE}.{make(f'{name}_{field_name}', sub)}"
        return name

    for name, entry in fields.MESSAGES.items():
        make(name, entry)
    return out


def generate() -> bool:
    """Write :data:`GENERATED` into agent/daemon; False (and one line on stderr) when it cannot."""
    try:
        from google.protobuf import descriptor_pb2
        import grpc_tools  # type: ignore[import-untyped]  # noqa: F401
    except ImportError as exc:
        print(f"nftpolicy: not generating the protobuf decoder ({exc}): the agent will use JSON", file=sys.stderr)
        return False
    fields = _fields()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        root = _proto_root(work)
        if root is None or not all((root / f).exists() for f in fields.PROTO_FILES):
            print("nftpolicy: not generating the protobuf decoder (no k8s.io/api generated.proto: set NFTPOLICY_K8S_PROTO, "
                  "or have go and tools/k8s): the agent will use JSON", file=sys.stderr)
            return False
        _protoc(f"-I{root}", "--include_imports", f"--descriptor_set_out={work / 'full.pb'}", *fields.PROTO_FILES)
        full = descriptor_pb2.FileDescriptorSet.FromString((work / "full.pb").read_bytes())
        cut = descriptor_pb2.FileDescriptorSet(file=[_cut(full, fields)])
        (work / "cut.pb").write_bytes(cut.SerializeToString())
        (work / "out").mkdir()
        _protoc(f"--descriptor_set_in={work / 'cut.pb'}", f"--python_out={work / 'out'}", f"--pyi_out={work / 'out'}", "k8s.proto")
        for name in GENERATED:
            shutil.copyfile(work / "out" / name, OUT / name)
    return True


class BuildPy(build_py):
    """``build_py`` after :func:`generate`."""

    def run(self) -> None:
        generate()
        super().run()


class K8sProto(Command):
    """``python setup.py k8s_proto``: :func:`generate` alone; fails when it cannot."""

    description = "generate agent/daemon/k8s_pb2.py from the pinned Kubernetes generated.proto files"
    user_options: list[tuple[str, str | None, str]] = []

    def initialize_options(self) -> None:
        pass

    def finalize_options(self) -> None:
        pass

    def run(self) -> None:
        if not generate():
            raise SystemExit(1)


setup(cmdclass={"build_py": BuildPy, "k8s_proto": K8sProto})
