"""The one place that imports the cffi extension, so a missing build is one clear error."""

from __future__ import annotations

import functools
from typing import Any


class NativeUnavailable(RuntimeError):
    """The compiled extension (native/prefetch.c) is missing or cannot be loaded."""


class Native:
    def __init__(self, ffi: Any, lib: Any) -> None:
        self.ffi = ffi
        self.lib = lib


@functools.cache
def load_native() -> Native:
    try:
        from kvprefetchd._native import ffi, lib
    except ImportError as error:
        raise NativeUnavailable(
            f"the native extension is not built ({error}); reinstall with `pip install .`"
        ) from error
    return Native(ffi, lib)
