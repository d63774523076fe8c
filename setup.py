"""setuptools glue for what pyproject.toml cannot say.

- The cffi extension: compiled from native/*.c in cffi API mode (liburing 2.3's prep
  helpers are static inline, so an ABI-mode binding cannot reach them).
  native/build_native.py decides whether liburing is there; without it the module still
  builds (with a loud warning) and reports io_uring as unavailable.
- The wheel is abi3 (cp311 and later): cffi's modules use only the limited API.
- The dependencies, because one is the client distribution (clients/python, `kvprefetch`)
  at exactly this version: the daemon imports its stats schema, and the two release together.
"""

import re
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
VERSION = re.search(r'^__version__ = "([^"]+)"',
                    (HERE / "daemon/kvprefetchd/__init__.py").read_text(), re.M)[1]

setup(
    cffi_modules=["native/build_native.py:ffibuilder"],
    install_requires=[
        f"kvprefetch=={VERSION}",
        "cffi>=1.15",
        "msgpack>=1.0.5",
        "cbor2>=5.4",
        "setproctitle>=1.3",
        "psutil>=5.9",
        "prometheus_client>=0.17",
    ],
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
