"""The lexical gate: which root a path is under, or why it is refused."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvprefetchd.roots.confine import Roots

ROOTS = Roots(("/kv", "/kv/nested", "/other/"), max_path_bytes=128)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("/kv/a/b.bin", (0, b"a/b.bin")),
        ("/kv//a.bin", (0, b"a.bin")),
        ("/kv/nested/x.bin", (1, b"x.bin")),
        ("/other/y", (2, b"y")),
        (b"/kv/\xff\xfe.bin", (0, b"\xff\xfe.bin")),
    ],
)
def test_paths_under_a_root_are_placed(path: str | bytes, expected: tuple[int, bytes]) -> None:
    assert ROOTS.place(path) == expected


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("kv/a", "relative"),
        ("/kvx/a", "outside_roots"),
        ("/etc/passwd", "outside_roots"),
        ("/kv", "outside_roots"),
        ("/kv/", "not_a_file"),
        ("/kv/../etc/passwd", "dotdot"),
        ("/kv/a/../../etc", "dotdot"),
        ("/kv/a\0b", "nul_byte"),
        ("/kv/" + "a" * 200, "too_long"),
        (7, "not_a_path"),
        (None, "not_a_path"),
    ],
)
def test_refusals_name_their_reason(path: object, reason: str) -> None:
    assert ROOTS.place(path) == reason


def test_dotdot_inside_a_name_is_not_a_component() -> None:
    assert ROOTS.place("/kv/a..b/..c") == (0, b"a..b/..c")


ONE = Roots(("/kv",), max_path_bytes=128)
# The same root plus one that never matches: placed by the general path, not the fast one.
GENERAL = Roots(("/kv", "/never-matches"), max_path_bytes=128)


@given(st.text(alphabet="/kv.a\0é", max_size=40) | st.text(max_size=200).map(lambda t: "/kv/" + t))
def test_the_one_root_fast_path_agrees_with_the_general_one(path: str) -> None:
    assert ONE.place(path) == GENERAL.place(path)


@pytest.mark.parametrize("char", ["a", "é", "€", "😀"])
@pytest.mark.parametrize("roots", [ONE, GENERAL], ids=["one-root", "general"])
def test_max_path_bytes_counts_utf8_bytes_not_characters(roots: Roots, char: str) -> None:
    """The kernel's limits are in bytes: a str path of multi-byte characters gets no more
    room than the same path sent as msgpack bin."""
    def of_bytes(n: int) -> str:
        room = n - len("/kv/")
        return "/kv/" + char * (room // len(char.encode())) + "a" * (room % len(char.encode()))

    at, over = of_bytes(128), of_bytes(129)
    assert isinstance(roots.place(at), tuple) and isinstance(roots.place(at.encode()), tuple)
    assert roots.place(over) == roots.place(over.encode()) == "too_long"
