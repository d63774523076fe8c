"""A file whose read really fails with EIO, for the tests of the failed outcome.

sysfs' power/autosuspend_delay_ms is a regular file (0644, st_size 4096) whose read
fails with EIO when the device does not use autosuspend (drivers/base/power/sysfs.c
autosuspend_delay_ms_show). Real, harmless (never written) and present on every Linux
with sysfs; where it reads fine or is absent, the test that wants it is skipped.
"""

from __future__ import annotations

import errno
import os

import pytest

SYSFS_CPU = "/sys/devices/system/cpu"
EIO_ATTRIBUTE = "power/autosuspend_delay_ms"


def real_eio() -> tuple[str, str]:
    """(base directory, path relative to it) of a file whose read fails with EIO here."""
    path = os.path.join(SYSFS_CPU, EIO_ATTRIBUTE)
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as error:
        pytest.skip(f"{path}: {error}")
    try:
        os.pread(fd, 4096, 0)
        pytest.skip(f"{path} is readable here")
    except OSError as error:
        if error.errno != errno.EIO:
            pytest.skip(f"{path}: {error}")
    finally:
        os.close(fd)
    return SYSFS_CPU, EIO_ATTRIBUTE
