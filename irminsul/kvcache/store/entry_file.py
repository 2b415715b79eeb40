"""An entry's file, in a directory that whoever can write it may fill with anything.

The disk tier reads a file at an entry's name only if it is a regular file no longer than the
longest entry the tier writes: it opens it without following a link or waiting on a FIFO
(``O_NOFOLLOW | O_NONBLOCK``), checks the opened file (``fstat``), and reads no more than that size.
A FIFO, a link (to /dev/zero, or to a valid entry elsewhere), a device, a socket, a directory or a
sparse giant is ``NotAnEntry``: a miss, never a stall or a read without end.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFDIR: "a directory",
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


class NotAnEntry(Exception):
    """A file at an entry's name that cannot be one: not a regular file, or longer than any entry."""


def why_not(st: os.stat_result, max_bytes: int) -> str | None:
    """Why a file of this (l)stat cannot be an entry, or None if it can."""
    if not stat.S_ISREG(st.st_mode):
        return f"{_KINDS.get(stat.S_IFMT(st.st_mode), 'a special file')}, not a regular file"
    if st.st_size > max_bytes:
        return f"{st.st_size} bytes, more than the longest entry ({max_bytes} bytes)"
    return None


def read_entry(path: Path, max_bytes: int) -> bytes:
    """The bytes of the regular file at `path` if it holds at most `max_bytes`, else NotAnEntry; opened
    without following a link or waiting on a FIFO. OSError as the disk raises it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK):  # (EMLINK: O_NOFOLLOW on a link, on the BSDs)
            raise NotAnEntry("a symbolic link, not a regular file") from None
        if e.errno == errno.ENXIO:
            raise NotAnEntry("a socket or a device, not a regular file") from None
        raise
    try:
        st = os.fstat(fd)
        why = why_not(st, max_bytes)
        if why is not None:
            raise NotAnEntry(why)
        blob = b""  # NOTE: no more than fstat's size: a file that grows meanwhile is cut, and fails to verify
        while len(blob) < st.st_size and (more := os.read(fd, st.st_size - len(blob))):
            blob += more
        return blob
    finally:
        os.close(fd)
