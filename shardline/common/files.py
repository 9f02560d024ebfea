"""Files that several processes may write at once: the cache folder, and publishing into it.

Shards of one replica start together and may convert the same model, build the same kernels or
measure the same machine choice at the same moment (in compose, from containers that share the
cache volume). Each writes its own temporary sibling and publishes it in one atomic step; the
first to publish wins and the others keep its copy, so a reader never sees half a file (or
folder), and every process reads the same answer.
"""

from __future__ import annotations

import fcntl
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
    another process publishes it first, that copy is kept and this one dropped. Returns `path`.

    A temporary file is locked (flock) while it is written, so that one a killed process left
    (a shard stopped while its weights were being kept: gigabytes) is told from one being
    written, and the next publish of the same path removes it."""
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = None
    if folder:
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}."))
    else:
        _remove_abandoned(path)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        fcntl.flock(fd, fcntl.LOCK_EX)
        tmp = Path(name)
    try:
        write(tmp)
        _move_unless_there(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
        if fd is not None:
            os.close(fd)
    return path


def _remove_abandoned(path: Path) -> None:
    """Removes the temporary files of `path` that no process holds locked: their writers died."""
    for tmp in path.parent.glob(f".{path.name}.*"):
        try:
            fd = os.open(tmp, os.O_RDONLY)
        except OSError:  # published or removed meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            tmp.unlink(missing_ok=True)
        except OSError:  # locked: being written
            pass
        finally:
            os.close(fd)


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
