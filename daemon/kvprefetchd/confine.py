"""The first of two gates that keep every open beneath an allowed root.

This gate is lexical and runs in the supervisor: it maps an absolute path to
(root, path relative to that root) or refuses it, touching no file system at
all. The second gate is the kernel's: workers open the relative part with
openat2(RESOLVE_BENEATH) against the root's directory fd (native/prefetch.c),
which catches what text cannot see, such as symlinks that lead out.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Placed:
    root_index: int
    relative: bytes


class Roots:
    """The allowed roots, longest first so nested roots pick the most specific one."""

    def __init__(self, roots: tuple[str, ...], max_path_bytes: int) -> None:
        self.roots = roots
        self._max = max_path_bytes
        ordered = sorted(range(len(roots)), key=lambda i: -len(roots[i]))
        self._prefixes = [(os.fsencode(roots[i]).rstrip(b"/") + b"/", i) for i in ordered]

    def place(self, path: object) -> Placed | str:
        """The root a path lies under, or the reason it is rejected.

        `..` is refused outright rather than normalised: a client that builds
        paths from hashes never needs it, and refusing is simpler to trust.
        """
        if isinstance(path, str):
            try:
                raw = path.encode("utf-8", "surrogateescape")
            except UnicodeEncodeError:
                return "path is not encodable"
        elif isinstance(path, bytes):
            raw = path
        else:
            return "path is not a string"
        if not raw.startswith(b"/"):
            return "relative path"
        if len(raw) > self._max:
            return "path too long"
        if b"\0" in raw:
            return "NUL byte in path"
        found = next(((p, i) for p, i in self._prefixes if raw.startswith(p)), None)
        if found is None:
            return "outside the allowed roots"
        prefix, index = found
        relative = raw[len(prefix) :].lstrip(b"/")
        if not relative:
            return "names a root itself, not a file"
        if b".." in relative.split(b"/"):
            return "'..' component"
        return Placed(index, relative)
