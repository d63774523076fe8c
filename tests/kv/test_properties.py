"""Properties of the chain and of the file selection, over generated prompts.

The CBOR check uses a clean-room encoder written from the spec's byte table (§2.1), so
a change in cbor2's output would be caught even for inputs no vector covers."""

from __future__ import annotations

import hashlib
from typing import Any

import cbor2
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_reference import file_path
from kvprefetchd import kv
from kvprefetchd.kv import hashing, layout

PARENT = hashing.none_hash("10")
token_ids = st.lists(st.integers(0, (1 << 32) - 1), max_size=300)
block_sizes = st.sampled_from([1, 2, 3, 16, 23, 24, 64])
extra_key: st.SearchStrategy[Any] = st.recursive(
    st.text(max_size=30) | st.integers(-(1 << 64), (1 << 64) - 1) | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=4).map(tuple),
    max_leaves=8,
)
block_extra = st.none() | st.lists(extra_key, max_size=4).map(tuple)


def head(major: int, value: int) -> bytes:
    """Shortest-form CBOR head (RFC 8949 §4.2.1), as the spec's byte table lists it."""
    if value < 24:
        return bytes([major << 5 | value])
    for code, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * width):
            return bytes([major << 5 | code]) + value.to_bytes(width, "big")
    raise ValueError(value)


def reference_cbor(value: Any) -> bytes:
    if value is None:
        return b"\xf6"
    if isinstance(value, int):
        return head(0, value) if value >= 0 else head(1, -1 - value)
    if isinstance(value, bytes):
        return head(2, len(value)) + value
    if isinstance(value, str):
        data = value.encode("utf-8")
        return head(3, len(data)) + data
    assert isinstance(value, tuple | list)
    return head(4, len(value)) + b"".join(reference_cbor(item) for item in value)


@given(tokens=st.lists(st.integers(0, (1 << 64) - 1), max_size=70), extra=block_extra)
def test_payload_is_the_canonical_cbor_of_the_spec(tokens: list[int], extra: Any) -> None:
    payload = hashing.block_payload(PARENT, tokens, extra)
    assert payload == reference_cbor((PARENT, tuple(tokens), extra))


@given(tokens=token_ids, size=block_sizes, cut=st.integers(0, 300))
def test_the_hashes_of_a_prefix_are_a_prefix_of_the_hashes(tokens: list[int], size: int,
                                                           cut: int) -> None:
    whole = hashing.block_hashes(tokens, hash_block_size=size, parent=PARENT)
    part = hashing.block_hashes(tokens[:cut], hash_block_size=size, parent=PARENT)
    assert len(whole) == len(tokens) // size
    assert part == whole[:len(tokens[:cut]) // size]


def mm_items(draw: st.DrawFn, length: int) -> tuple[kv.MMFeature, ...]:
    cuts = sorted(draw(st.lists(st.integers(0, max(length + 20, 1)), max_size=8, unique=True)))
    items = []
    for start, end in zip(cuts[::2], cuts[1::2], strict=False):
        items.append(kv.MMFeature(f"item-{start}", start, end - start))
    return tuple(items)


@st.composite
def prompts(draw: st.DrawFn) -> kv.Prompt:
    tokens = draw(token_ids)
    return kv.Prompt(
        token_ids=tokens,
        cache_salt=draw(st.none() | st.text(max_size=8)),
        lora=draw(st.none() | st.builds(kv.LoRA, st.text(max_size=8), st.text(max_size=8))),
        mm_features=mm_items(draw, len(tokens)),
    )


@settings(max_examples=200)
@given(prompt=prompts(), size=block_sizes, cut=st.integers(0, 300),
       era=st.sampled_from(["A", "B", "B2", "C"]))
def test_prefix_property_holds_with_extra_keys(prompt: kv.Prompt, size: int, cut: int,
                                               era: hashing.Era) -> None:
    kwargs: dict[str, Any] = {"hash_block_size": size, "parent": PARENT, "era": era}
    whole = hashing.prompt_block_hashes(prompt, **kwargs)
    shorter = kv.Prompt(prompt.token_ids[:cut], prompt.cache_salt, prompt.lora,
                        prompt.mm_features)
    assert hashing.prompt_block_hashes(shorter, **kwargs) == whole[:len(shorter.token_ids) // size]


@settings(max_examples=200)
@given(prompt=prompts(), size=block_sizes, era=st.sampled_from(["A", "B", "B2", "C"]))
def test_every_overlapping_mm_item_and_only_those_are_keyed(prompt: kv.Prompt, size: int,
                                                            era: hashing.Era) -> None:
    """The overlap walk equals the plain definition: items overlapping [start, end),
    in offset order; LoRA on every block, the salt on block 0 only."""
    extras = hashing.extra_keys_for(prompt, size, era) or []
    for index, extra in enumerate(extras):
        start, end = index * size, (index + 1) * size
        keys = list(extra or ())
        if prompt.lora is not None:
            assert keys.pop(0) == (("lora", prompt.lora.name, prompt.lora.path) if era == "C"
                                   else prompt.lora.name)
        if prompt.cache_salt and index == 0:
            assert keys.pop() == (("cache_salt", prompt.cache_salt) if era == "C"
                                  else prompt.cache_salt)
        overlapping = [m for m in prompt.mm_features if m.offset < end and
                       m.offset + m.length > start]
        assert [k if era == "A" else k[-2] for k in keys] == [m.identifier for m in overlapping]
        if era != "A":
            assert [k[-1] for k in keys] == [m.offset - start for m in overlapping]


@given(hashes=st.lists(st.binary(min_size=32, max_size=32), max_size=40, unique=True),
       factor=st.integers(1, 9), groups=st.integers(1, 3), rank_count=st.integers(1, 4))
def test_files_are_the_last_hash_of_each_full_run(hashes: list[bytes], factor: int, groups: int,
                                                  rank_count: int) -> None:
    paths = layout.plan_paths("/r/m_0123456789ab", range(rank_count), (factor,) * groups,
                              [hashes])
    named = [hashes[i] for i in range(factor - 1, len(hashes), factor)]
    assert len(paths) == rank_count * groups * (len(hashes) // factor)
    assert len(paths) == layout.count_files([len(hashes)], (factor,) * groups, rank_count)
    expected = [file_path("/r/m_0123456789ab", r, g, h)
                for r in range(rank_count) for g in range(groups) for h in named]
    assert paths == expected


@given(block_hash=st.binary(min_size=1, max_size=32))
def test_engine_key_is_the_last_eight_bytes(block_hash: bytes) -> None:
    assert kv.engine_key(block_hash) == int.from_bytes(block_hash[-8:], "big")


@given(text=st.text(max_size=40))
def test_none_hash_is_the_sha256_of_the_cbor_text(text: str) -> None:
    assert hashing.none_hash(text) == hashlib.sha256(cbor2.dumps(text)).digest()
