"""What a file system's own disk cache holds of a file, seen without opening it there.

Where the near tier is the file system's disk cache (s3fs `use_cache`, rclone
`--vfs-cache-mode full`), the page cache says nothing of what the consumer will find:
rclone's files are cold in the page cache at every open and still served from its disk
cache with no request to the endpoint (measured: bench/realtier.py). Both keep a sparse
copy per file under a directory the profile knows (tiers.fs_cache_dir): its allocated
blocks are what was fetched. A stat of that copy, on a local disk, answers "already
warm" and `check` without an open on the mount (which costs s3fs two HEAD requests).
"""

from __future__ import annotations

import glob
import os


class FsCacheView:
    def __init__(self) -> None:
        self._bases: dict[str, str] = {}  # pattern -> directory, once it exists

    def base(self, pattern: str) -> str:
        """The directory a pattern names ("" while none exists yet: rclone makes its
        directory at its first read)."""
        found = self._bases.get(pattern)
        if found is None:
            matches = sorted(glob.glob(pattern))
            if not matches:
                return ""
            found = self._bases[pattern] = matches[0]
        return found

    def cached(self, pattern: str, relative: bytes) -> tuple[int, int] | None:
        """(size, bytes on disk) of the copy of `relative`, None when there is none
        (warm_enough judges them)."""
        base = self.base(pattern)
        if not base:
            return None
        try:
            info = os.stat(os.path.join(os.fsencode(base), relative), follow_symlinks=False)
        except OSError:
            return None
        return info.st_size, min(info.st_size, info.st_blocks * 512)


def warm_enough(size: int, on_disk: int, span: int) -> bool:
    want = min(size, span)
    return want > 0 and on_disk >= want
