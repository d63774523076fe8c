"""cffi (API mode) build script for kvprefetchd._native.

setup.py names it as ``cffi_modules=["native/build_native.py:ffibuilder"]``;
setuptools runs it from the project root (pip install . / pip install -e .).
It can also be run directly: ``python native/build_native.py`` builds the
module under build/cffi/ (from any cwd).

The cdef is native/kvprefetch.h itself, minus its preprocessor lines other
than ``#define NAME <integer>`` (which cffi's cdef accepts).  Every native/*.c
is compiled into the module (prefetch.c maps them); every native/*.h is a
dependency, so touching internal.h rebuilds it.

liburing: a tiny program is compiled and linked against -luring; if that
works the extension is built with -DKVP_HAVE_LIBURING and linked with uring,
otherwise without (the io_uring engines then fail kvp_ctx_new with ENOSYS and
kvp_engine_detect says "built without liburing").  KVP_NO_LIBURING=1 in the
environment forces the latter.
"""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys
import sysconfig
import tempfile
import warnings

from cffi import FFI

_HERE = os.path.dirname(os.path.abspath(__file__))
# setuptools runs us from the project root and wants source paths relative to
# it; a direct run (cffi's compile() chdirs into its tmpdir) needs absolute ones.
_NATIVE = _HERE if __name__ == "__main__" else os.path.relpath(_HERE)

_INT_DEFINE = re.compile(
    r"^\s*#\s*define\s+[A-Za-z_]\w*\s+-?(0[xX][0-9a-fA-F]+|\d+)[uUlL]*\s*(/\*.*\*/\s*)?$"
)

_URING_TEST = r"""
#include <liburing.h>
int main(void)
{
    struct io_uring ring;
    if (io_uring_queue_init(1, &ring, 0) == 0)
        io_uring_queue_exit(&ring);
    return 0;
}
"""


def cdef_source(header: str) -> str:
    """The header as cffi's cdef wants it: drop preprocessor lines except
    integer #defines (comments are fine: cffi strips them)."""
    out = []
    for line in header.splitlines():
        if line.lstrip().startswith("#") and not _INT_DEFINE.match(line):
            continue
        out.append(line)
    return "\n".join(out) + "\n"


def links(program: str, library: str, header: str) -> bool:
    """Whether a tiny program using `library` compiles and links here."""
    cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "t.c")
        with open(src, "w") as f:
            f.write(program)
        try:
            r = subprocess.run(
                [*cc, src, "-o", os.path.join(tmp, "t"), f"-l{library}"],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                check=False,
            )
        except OSError:  # no compiler to ask: trust the header
            return os.path.exists(f"/usr/include/{header}")
        return r.returncode == 0


def have_liburing() -> bool:
    if os.environ.get("KVP_NO_LIBURING", "") not in ("", "0"):
        return False
    return links(_URING_TEST, "uring", "liburing.h")


with open(os.path.join(_HERE, "kvprefetch.h")) as _f:
    _HEADER = _f.read()

_URING = have_liburing()
if not _URING and os.environ.get("KVP_NO_LIBURING", "") in ("", "0"):
    # pip shows a build's output only with -v, so say it on stderr and as a warning too: a
    # daemon built this way serves (pread, fadvise), but `--engine io_uring` is refused.
    _NO_URING = (
        "kvprefetchd: liburing NOT FOUND (no -luring, no <liburing.h>): building WITHOUT the "
        "io_uring engine. Install liburing-dev (Debian/Ubuntu) or liburing-devel and rebuild, "
        "or set KVP_NO_LIBURING=1 to build without it on purpose."
    )
    sys.stderr.write("\n" + "!" * 78 + "\n" + _NO_URING + "\n" + "!" * 78 + "\n\n")
    warnings.warn(_NO_URING, stacklevel=1)

ffibuilder = FFI()
ffibuilder.cdef(cdef_source(_HEADER))
ffibuilder.set_source(
    "kvprefetchd._native",
    '#include <stddef.h>\n#include <stdint.h>\n#include "kvprefetch.h"\n',
    sources=sorted(glob.glob(os.path.join(_NATIVE, "*.c"))),
    include_dirs=[_NATIVE],
    depends=sorted(glob.glob(os.path.join(_NATIVE, "*.h"))),
    define_macros=[("KVP_HAVE_LIBURING", "1")] if _URING else [],
    libraries=(["uring"] if _URING else []) + ["pthread", "m"],
    extra_compile_args=["-O2"],
)

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=os.path.join(os.path.dirname(_HERE), "build", "cffi"), verbose=True)
