"""setuptools glue for the one thing pyproject.toml cannot say: the cffi extension.

The native module is compiled from native/*.c in cffi API mode (liburing
2.3's prep helpers are static inline, so an ABI-mode binding cannot reach them).
native/build_native.py decides whether liburing is there; without it the module
still builds and reports io_uring as unavailable.
"""

from setuptools import setup

setup(cffi_modules=["native/build_native.py:ffibuilder"])
