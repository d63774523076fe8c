"""The first of two gates that keep every open beneath an allowed root.

This gate is lexical and runs in the supervisor: it maps an absolute path to
(root, path relative to that root) or refuses it, touching no file system at
all. The second gate is the kernel's: workers open the relative part with
openat2(RESOLVE_BENEATH) against the root's directory fd (native/open.c),
which catches what text cannot see, such as symlinks that lead out.

Admission takes the relative part in its canonical spelling (`Roots.place_canonical`):
`//`, `/./`, a leading `./` and a trailing `/.` collapsed, a trailing `/` kept (it still
asks for a directory). That changes nothing the kernel resolves, but makes every
spelling of a file one key for the worker's memory of recent reads and one shard:
131,072 `./`-padded spellings of one file were 131,072 reads and grew a worker by 146 MiB.
"""

from __future__ import annotations

import os

# (root index, path relative to that root): a plain tuple, because the
# supervisor builds one per path on the request path and a dataclass costs ~1 µs.
Placed = tuple[int, bytes]


class Roots:
    """The allowed roots, longest first so nested roots pick the most specific one."""

    def __init__(self, roots: tuple[str, ...], max_path_bytes: int) -> None:
        self.roots = roots
        self.max_path_bytes = self._max = max_path_bytes
        ordered = sorted(range(len(roots)), key=lambda i: -len(roots[i]))
        self._prefixes = [(os.fsencode(roots[i]).rstrip(b"/") + b"/", i) for i in ordered]
        # The common case, one root and plain names, is placed without further calls. The
        # limit is in bytes, as the kernel counts them: what a str path's relative part may
        # take once encoded, beside the root's prefix.
        self._only: tuple[str, int] | None = None
        self._only_room = 0
        if len(roots) == 1:
            self._only = (roots[0].rstrip("/") + "/", 0)
            self._only_room = max_path_bytes - len(self._prefixes[0][0])

    def prefixes(self) -> list[tuple[bytes, int]]:
        """Each root as a prefix with one trailing `/`, and its index, longest first: the
        order a path is matched in (native/admit.c matches the same list)."""
        return list(self._prefixes)

    def place(self, path: object) -> Placed | str:
        """The root a path lies under, or the reason it is rejected (a reason code of
        docs/protocol.md, "Failures").

        `..` is refused outright rather than normalised: a client that builds
        paths from hashes never needs it, and refusing is simpler to trust.
        This runs once per path on the acknowledgement path, so it works on
        the str as decoded and encodes only the relative part.
        """
        only = self._only
        if only is not None and type(path) is str and path.startswith(only[0]):
            relative_text = path[len(only[0]) :]
            if (
                relative_text
                and len(path) <= self._max  # characters <= bytes: a cheap first test
                and relative_text[0] != "/"
                and "\0" not in relative_text
                and ".." not in relative_text
            ):
                # A str decoded from msgpack is valid UTF-8: encode() cannot fail.
                relative = relative_text.encode()
                if len(relative) <= self._only_room:
                    return (only[1], relative)
        # Any other root, or a name the fast path did not take: on the bytes the kernel sees.
        if isinstance(path, str):
            try:
                raw = path.encode()
            except UnicodeEncodeError:
                return "not_a_path"
        elif isinstance(path, bytes):
            raw = path
        else:
            return "not_a_path"
        if len(raw) > self._max:
            return "too_long"
        for prefix, index in self._prefixes:
            if raw.startswith(prefix):
                relative = raw[len(prefix) :]
                if b"\0" in relative:
                    return "nul_byte"
                return self._check(index, relative)
        return self._unplaced(raw.startswith(b"/"), b"\0" in raw)

    def path_of(self, index: int, relative: bytes) -> str | bytes:
        """The absolute path of a placed file, for a reply: str where it is UTF-8."""
        raw = os.fsencode(self.roots[index]).rstrip(b"/") + b"/" + relative
        try:
            return raw.decode()
        except UnicodeDecodeError:
            return raw

    def place_canonical(self, path: object) -> Placed | str:
        """`place`, with the relative part in its canonical spelling (the module's doc).

        The common name is canonical already. The relative part is a suffix of the path, so
        a str path without `//`, `./` or a final `.` has none of them in its relative part
        either: tested on the str, as decoded, because `in` on str is ~10x cheaper than on
        bytes (0.04 against 0.35 us here, once per path of every request)."""
        placed = self.place(path)
        if type(placed) is tuple and (
            type(path) is not str or "//" in path or "./" in path or path[-1] == "."
        ):
            relative = placed[1]
            if b"//" in relative or b"./" in relative or relative.endswith(b"."):
                return (placed[0], canonical(relative))
        return placed

    @staticmethod
    def _check(index: int, relative: bytes) -> Placed | str:
        if relative.startswith(b"/"):
            relative = relative.lstrip(b"/")
        if not relative:
            return "not_a_file"
        if b".." in relative and b".." in relative.split(b"/"):
            return "dotdot"
        return (index, relative)

    @staticmethod
    def _unplaced(absolute: bool, has_nul: bool) -> str:
        if not absolute:
            return "relative"
        if has_nul:
            return "nul_byte"
        return "outside_roots"


def canonical(relative: bytes) -> bytes:
    """One spelling per file: empty and `.` components dropped (`..` never gets here), a
    trailing `/` or `/.` kept as one `/`; a name for the root itself stays `.`, which the
    worker refuses as not a regular file, as it did every spelling of it."""
    parts = relative.split(b"/")
    kept = [part for part in parts if part and part != b"."]
    if not kept:
        return b"."
    spelled = b"/".join(kept)
    return spelled + b"/" if parts[-1] in (b"", b".") else spelled
