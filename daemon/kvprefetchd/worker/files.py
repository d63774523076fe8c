"""A share's files as a worker handles them, without a Python object per file.

A Warm message carries its files as a Share (channel.py: root indexes, NUL-ended names);
`Files` names some of them by index, and decodes the names only once one is needed.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from kvprefetchd.channel import Share


class Files:
    """Some files of a share, by their indexes in it. Names are decoded from the share
    once, when needed; the probe reads the share's own buffers while the files are all
    of it, and buffers made for the subset otherwise."""

    __slots__ = ("_names", "count", "indexes", "root_of", "share", "whole")

    def __init__(self, share: Share, root_of: array[int], indexes: Sequence[int],
                 names: list[bytes] | None, whole: bool) -> None:
        self.share = share
        self.root_of = root_of  # every file of the share
        self.indexes = indexes
        self.count = len(indexes)
        self._names = names
        self.whole = whole

    @classmethod
    def of(cls, share: Share) -> Files:
        root_of = share.root_indexes()
        return cls(share, root_of, range(len(root_of)), None, True)

    def all_names(self) -> list[bytes]:
        """Every name of the share, by index."""
        if self._names is None:
            self._names = self.share.paths.split(b"\0")
        return self._names

    def as_share(self) -> Share:
        """These files as a share of their own, as the probe reads them."""
        if self.whole:
            return self.share
        names, root_of = self.all_names(), self.root_of
        return Share.of([root_of[i] for i in self.indexes], [names[i] for i in self.indexes])

    def subset(self, indexes: list[int]) -> Files:
        if len(indexes) == self.count:
            return self
        return Files(self.share, self.root_of, indexes, self._names, False)
