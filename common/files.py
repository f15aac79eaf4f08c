"""Atomic files: a file or folder is either the old one or the whole new one, never half-written;
and the folders named by flags, checked before anything is written in them (check_folder).
"""

import errno
import json
import os
from contextlib import contextmanager
from pathlib import Path

from common.errors import UserError


@contextmanager
def atomic_write(path: Path):
    """Open a new file for ``path`` in binary mode; on success it reaches the disk (fsync) and
    replaces ``path`` in one rename, on failure it is removed. Readers see the old file or the whole
    new one: a process killed while writing leaves the previous file intact, where writing in place
    would leave a half-written one that the next run would read. Every file the runs write goes
    through it.

        with atomic_write(output_dir / "config.json") as f:
            f.write(text.encode())
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # One temporary name per file: a leftover of a killed writer is removed, not piled up. Each
    # file has one writer at a time (the main process; the data cache holds a file lock).
    partial = path.with_name(f".tmp-{path.name}")
    partial.unlink(missing_ok=True)  # a leftover, or a link planted there: never written through
    try:
        with open(partial, "xb") as f:  # x: a name that is there again (a link) is an error
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)  # the rename itself reaches the disk


def write_json(path: Path, obj) -> None:
    """``obj`` as indented JSON in ``path``, atomically."""
    with atomic_write(path) as f:
        f.write((json.dumps(obj, indent=2) + "\n").encode())


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (a rename, a new file) to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:  # some network and FUSE filesystems cannot: their renames stand
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush every file and folder under ``path`` to the disk, before it is renamed into place."""
    for root, _, files in os.walk(path):
        for name in files:
            with open(Path(root) / name, "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(root))


def check_folder(flag: str, path: str | None) -> None:
    """A folder flag naming a file, a path under a file, or a folder that cannot be written in fails
    at the first file written there, with a traceback: say so now, in one line."""
    if path is None:
        return
    given = Path(path)
    existing = next(p for p in (given, *given.parents) if p.exists())  # "." or "/" at the latest
    if not existing.is_dir():
        raise UserError(f"{flag} {path}: must be a folder, but "
                        f"{'it' if existing == given else existing} is a file; choose another "
                        f"{flag}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: must be a folder you can write in, but {existing} is not "
                        f"writable; choose another {flag}")


def check_file(flag: str, path: Path, then: str) -> None:
    """A file flag naming a folder or nothing: one line saying which, then ``then`` (what to do)."""
    if path.is_dir():
        weights = sorted(p.name for p in path.glob("*.safetensors"))[:1]
        raise UserError(f"{flag} {path}: is a folder, not a file"
                        f"{f' (it holds {weights[0]})' if weights else ''}; {then}")
    if not path.is_file():
        raise UserError(f"{flag} {path}: no such file; {then}")
