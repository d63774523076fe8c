"""The native admission (native/admit.c) against the Python gate it must equal.

confine.py and admit.admit stay the reference; the Admitter takes plain-str requests
through kvp_admit. Both must give the same shares byte for byte, the same refusals with
the same reasons, the same drops and the same room, on every spelling a client may send.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvprefetchd.roots.confine import Roots
from kvprefetchd.supervisor.admit import Admission, Admitter, admit

ROOTS = ("/kv", "/kv/deep", "/data/models")
TRICKY = [
    "/kv/a.bin", "/kv/deep/b.bin", "/kv/deeper/c.bin", "/data/models/x/y.bin",
    "/kv", "/kv/", "/kv//", "/kv/.", "/kv/./", "/kv//a//b", "/kv/./a/./b", "/kv/a/.",
    "/kv/a/", "/kv/a/./", "/kv/..", "/kv/a/../b", "/kv/a/..b", "/kv/..a/b", "/kv/a/b..",
    "/kv/.../x", "/kv/.hidden", "kv/a.bin", "", "/", "/etc/passwd", "/kvx/a", "/data/model",
    "/data/models", "/data/models/", "/kv/é/ü.bin", "/kv/" + "n" * 40, "/kv/" + "n" * 80,
    "/kv///deep//z", "/kv/deep/../z", "./kv/a", "/kv/a\\b", "/kv/ a ", "/kv/a.",
    "/kv/a..", "/kv/.a.", "/kv/deep", "/kv/deep/", "/kv/deep/.", "/kv/deep//x/.",
]


def same(native: Admission, python: Admission) -> None:
    assert native.shares == python.shares
    assert native.rejected_paths == python.rejected_paths
    assert native.dropped_paths == python.dropped_paths
    assert (native.accepted, native.dropped, native.room) == (
        python.accepted, python.dropped, python.room)


@pytest.mark.parametrize("room", [[1000, 1000, 1000], [2, 0, 5], [1, 1, 1]])
def test_native_admission_equals_the_python_gate_on_tricky_spellings(room: list[int]) -> None:
    roots = Roots(ROOTS, 64)
    admitter = Admitter(roots, len(room))
    before = admitter.native_requests
    same(admitter.admit(list(TRICKY), list(room)), admit(list(TRICKY), roots, list(room)))
    assert admitter.native_requests == before + 1  # it really went through kvp_admit


def test_native_admission_equals_the_python_gate_on_random_paths() -> None:
    rng = random.Random(16)
    parts = ["/", "/", ".", "..", "a", "bc", "é", "kv", "deep", "data", "models", "x.bin"]
    roots = Roots(ROOTS, 48)
    admitter = Admitter(roots, 4)
    for _ in range(300):
        paths = []
        for _ in range(rng.randint(1, 60)):
            head = rng.choice(["/kv/", "/kv/deep/", "/data/models/", "/", "", "/kv"])
            paths.append(head + "".join(rng.choice(parts) for _ in range(rng.randint(0, 12))))
        room = [rng.randint(0, 20) for _ in range(4)]
        same(admitter.admit(list(paths), list(room)), admit(list(paths), roots, list(room)))


def test_requests_the_native_gate_cannot_take_go_through_the_python_one() -> None:
    roots = Roots(ROOTS, 64)
    admitter = Admitter(roots, 2)
    before = admitter.native_requests
    odd: list[list[Any]] = [
        ["/kv/a", "/kv/b\0c"],   # a NUL inside a name: the buffer would not hold n names
        ["/kv/a", b"/kv/b"],     # a bin path
        ["/kv/a", 7, None],      # values that are no path
    ]
    for paths in odd:
        same(admitter.admit(list(paths), [10, 10]), admit(list(paths), roots, [10, 10]))
    assert admitter.native_requests == before
    reasons = [reason for _, reason in admitter.admit(["/kv/b\0c", 7], [10, 10]).rejected_paths]
    assert reasons == ["nul_byte", "not_a_path"]


def test_an_empty_request_admits_nothing_and_reports_the_room() -> None:
    admitter = Admitter(Roots(ROOTS, 64), 2)
    admission = admitter.admit([], [3, 5])
    assert admission.shares == [None, None] and admission.room == 6


def test_a_huge_request_is_admitted_whole_and_its_buffers_do_not_stay() -> None:
    roots = Roots(("/kv",), 4096)
    admitter = Admitter(roots, 2)
    paths = [f"/kv/{i:08x}/{'p' * 100}.bin" for i in range(100_000)]
    big = admitter.admit(paths, [10**6, 10**6])
    assert big.accepted == len(paths)
    same(admitter.admit(paths[:50], [10, 10]), admit(paths[:50], roots, [10, 10]))
