"""A Warm message's files as a worker handles them, and what it reports of them.

The message carries its files as two buffers (root indexes, NUL-ended names: admit.Share);
`Files` names some of them by index without a Python object per file until one is needed,
and `Tally` gathers the files of one share that were settled alike, which a Done reports
as one record.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from kvprefetchd.channel import Warm
from kvprefetchd.supervisor.admit import Share, root_indexes


def roots_of(message: Warm) -> array[int]:
    """Each file's root index, from the message's buffer."""
    return root_indexes(message.roots)


class Files:
    """Some files of a Warm message, by their indexes in it. Names are decoded from the
    message once, when needed; the probe reads the message's own buffers while the files
    are all of it, and buffers made for the subset otherwise."""

    __slots__ = ("_names", "count", "indexes", "message", "root_of", "whole")

    def __init__(self, message: Warm, root_of: array[int], indexes: Sequence[int],
                 names: list[bytes] | None, whole: bool) -> None:
        self.message = message
        self.root_of = root_of  # every file of the message
        self.indexes = indexes
        self.count = len(indexes)
        self._names = names
        self.whole = whole

    @classmethod
    def of(cls, message: Warm) -> Files:
        root_of = roots_of(message)
        return cls(message, root_of, range(len(root_of)), None, True)

    def all_names(self) -> list[bytes]:
        """Every name of the message, by index."""
        if self._names is None:
            self._names = self.message.paths.split(b"\0")
        return self._names

    def buffers(self) -> tuple[bytes, bytes]:
        """(root indexes, NUL-ended names) of these files, as the probe reads them."""
        if self.whole:
            return self.message.roots, self.message.paths
        names, root_of = self.all_names(), self.root_of
        share = Share.of([root_of[i] for i in self.indexes], [names[i] for i in self.indexes])
        return share.roots, share.paths

    def subset(self, indexes: list[int]) -> Files:
        if len(indexes) == self.count:
            return self
        return Files(self.message, self.root_of, indexes, self._names, False)


class Tally:
    """Files of one share settled alike (read or resident): a count, the bytes read, and
    their indexes, which the books keep should this worker die with the rest out."""

    __slots__ = ("count", "indexes", "nbytes")

    def __init__(self) -> None:
        self.count = 0
        self.nbytes = 0
        self.indexes = array("I")

    def add_one(self, index: int, nbytes: int) -> None:
        self.count += 1
        self.nbytes += nbytes
        self.indexes.append(index)

    def add(self, indexes: Sequence[int]) -> None:
        """Files that were found warm: nothing read."""
        self.count += len(indexes)
        self.indexes.extend(indexes)
