"""Running a bench's part with the code of another checkout (``--against DIR``: main, exported with
``git archive main | tar -x -C /tmp/main-src``, or a worktree), for figures side by side."""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path


def shadow(tree: str) -> Path:
    """A directory whose ``nftpolicy`` is checkout ``tree`` (a symlink), for PYTHONPATH: it comes
    before the editable install's finder."""
    where = Path(tempfile.mkdtemp(prefix="nftp-against"))
    (where / "nftpolicy").symlink_to(Path(tree).resolve())
    return where


def git_head(tree: str | None) -> str:
    """The short commit of checkout ``tree`` (None: this one), or its directory's name when it
    is no git checkout (an exported tree)."""
    where = tree or str(Path(__file__).resolve().parents[1])
    head = subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    return head or Path(where).name
