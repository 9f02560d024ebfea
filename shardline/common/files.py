"""Files that several processes may write at once: the cache folder, and publishing into it.

Shards of one replica start together and may convert the same model, build the same kernels or
measure the same machine choice at the same moment (in compose, from containers that share the
cache volume). Each writes its own temporary sibling and publishes it in one atomic step; the
first to publish wins and the others keep its copy, so a reader never sees half a file (or
folder), and every process reads the same answer.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def cache_root() -> Path:
    """Where converted weights, tokenizers, built kernels and machine choices live."""
    return Path(os.environ.get("SHARDLINE_CACHE", Path.home() / ".cache" / "shardline"))


def publish(path: Path, write: Callable[[Path], None], folder: bool = False) -> Path:
    """Makes `path` exist, written whole by `write(tmp)` into a temporary sibling (an empty
    folder when `folder`, else a file) and then moved into place. If `path` exists already, or
    another process publishes it first, that copy is kept and this one dropped. Returns `path`."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    if folder:
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    else:
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        os.close(fd)
        tmp = Path(name)
    try:
        write(tmp)
        _move_unless_there(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
    return path


def _move_unless_there(tmp: Path, path: Path) -> None:
    if tmp.is_dir():
        try:
            tmp.rename(path)  # fails when `path` is a folder with content already
        except OSError:
            if not path.exists():
                raise
        return
    try:
        os.link(tmp, path)  # unlike a rename, never replaces what another process published
    except FileExistsError:
        pass
    except OSError:  # a filesystem without hard links: a rename, unless someone got there first
        if not path.exists():
            os.replace(tmp, path)
