"""An audit of which files get opened, from the kernel's own inotify events.

IN_OPEN fires for every real open of a file in a watched directory, by any
process, but not for O_PATH opens (fsnotify skips FMODE_PATH files): exactly
the line between "looked at the name" and "opened the file" that the daemon's
confinement promises never to cross outside its roots.
"""

from __future__ import annotations

import ctypes
import os
import select
import struct
from pathlib import Path

IN_OPEN = 0x00000020
IN_ACCESS = 0x00000001
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
EVENT = struct.Struct("iIII")

_libc = ctypes.CDLL(None, use_errno=True)


class OpenAudit:
    """Records IN_OPEN/IN_ACCESS events in the watched directories until closed."""

    def __init__(self, *directories: Path) -> None:
        self.fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.watches: dict[int, Path] = {}
        for directory in directories:
            wd = _libc.inotify_add_watch(self.fd, os.fsencode(directory), IN_OPEN | IN_ACCESS)
            if wd < 0:
                raise OSError(ctypes.get_errno(), f"inotify_add_watch {directory}")
            self.watches[wd] = directory

    def events(self, settle: float = 0.2) -> list[Path]:
        """Every path opened or read so far (the directory itself when no name is given)."""
        seen: list[Path] = []
        poller = select.poll()
        poller.register(self.fd, select.POLLIN)
        while poller.poll(int(settle * 1000)):
            try:
                data = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            offset = 0
            while offset < len(data):
                wd, _mask, _cookie, length = EVENT.unpack_from(data, offset)
                name = data[offset + EVENT.size : offset + EVENT.size + length].rstrip(b"\0")
                offset += EVENT.size + length
                directory = self.watches[wd]
                seen.append(directory / os.fsdecode(name) if name else directory)
        return seen

    def close(self) -> None:
        os.close(self.fd)
