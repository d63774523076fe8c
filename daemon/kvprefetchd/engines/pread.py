"""pread: blocking reads of each head, spread over a few threads inside the native call.

The portable fallback that needs nothing but read(2); a real read is what
promotes a file on a tiered file system.
"""

from kvprefetchd.engines.base import Engine


class PreadEngine(Engine):
    name = "pread"
    native_engine = "KVP_ENGINE_PREAD"
