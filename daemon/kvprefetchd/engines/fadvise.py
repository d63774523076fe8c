"""fadvise: posix_fadvise(WILLNEED) per head, then a confirming read.

WILLNEED only starts the I/O; the confirming pread waits for pages still in
flight and re-reads any the host's reclaimer already took, so `read` means the
head really is resident when the outcome is sent.
"""

from kvprefetchd.engines.base import Engine


class FadviseEngine(Engine):
    name = "fadvise"
    native_engine = "KVP_ENGINE_FADVISE"
