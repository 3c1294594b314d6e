"""Python's garbage collector around bulk loads."""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Run the body without Python's cyclic garbage collector (restored afterwards). Building a
    cluster's worth of objects that all stay alive otherwise triggers collection after
    collection over a growing heap: parsing a 50,000-pod dump takes 4x as long with it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
