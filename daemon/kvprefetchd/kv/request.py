"""A KV request: parse and bound it, then resolve it to block hashes and file paths.

The shape is docs/protocol.md's "KV requests": a profile (`model`, the name of a
configured one, or inline `hash` + `layout` maps), then the prompts (`prompts`, each
{token_ids, cache_salt, lora, mm_features}) or `block_hashes` (one array of 32-byte
hashes per prompt). The golden vectors' `inputs` are accepted as they are too: a single
prompt as `request` (or as top-level `token_ids`), layout keys at the top level,
`hash.vllm_block_size`, and `explicit_extra_keys` (typed JSON, tests/vectors/README.md).

Each prompt is its own chain from NONE_HASH and its own file selection; concatenating
prompts (as the router PR #1156 did) misaligns every prompt after the first.

    request = parse_kv_request(message, profiles, limits)      # KVRequestError
    resolution = resolve(request, fingerprint=...)              # pure CPU, no I/O
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvprefetchd.kv import layout
from kvprefetchd.kv.errors import KVRequestError
from kvprefetchd.kv.hashing import BlockExtra, ExtraKey, LoRA, MMFeature, Prompt
from kvprefetchd.kv.profile import Profile, ProfileBounds
from kvprefetchd.kv.specs import FINGERPRINT_RE, MAX_TOKEN_COUNT

BLOCK_HASH_BYTES = 32  # sha256 and sha256_cbor
MAX_EXTRA_KEY_DEPTH = 8
_U64 = (1 << 64) - 1

PROMPT_SOURCES = ("prompts", "block_hashes", "request", "token_ids")


@dataclass(frozen=True)
class Limits:
    """Bounds on one KV request, every one checked before any hash or path is computed;
    a request beyond them is refused as `too_large`, naming the limit."""

    max_prompts: int = 64
    max_tokens: int = 1 << 20  # over all prompts of the request
    # Block hashes named, or to compute (inline block_size = 1: a sha256 step per token).
    max_block_hashes: int = 1 << 16
    max_mm_features: int = 4096  # per prompt
    max_files: int = 1 << 18  # paths the request may map to
    max_plan_bytes: int = 32 << 20  # the bytes of those paths (an upper bound)
    max_ranks: int = 1024  # an inline layout's tp x pp x pcp (and each of them)
    max_kv_cache_groups: int = 64  # an inline layout's groups

    @property
    def profile_bounds(self) -> ProfileBounds:
        return ProfileBounds(max_ranks=self.max_ranks,
                             max_kv_cache_groups=self.max_kv_cache_groups)


@dataclass(frozen=True)
class KVRequest:
    """A validated KV request: exactly one of `prompts` and `block_hashes` is set. What
    resolving it costs is known before it starts: `blocks` (block hashes), `files` (paths
    before de-duplication) and `plan_bytes` (an upper bound of their bytes)."""

    profile: Profile
    prompts: tuple[Prompt, ...] | None = None
    block_hashes: tuple[tuple[bytes, ...], ...] | None = None
    blocks: int = 0
    files: int = 0
    plan_bytes: int = 0


@dataclass(frozen=True)
class Resolution:
    """What a KV request maps to: per-prompt block hashes and every file path.

    `paths` are ordered rank-major, then group, then prompt, then file order, and
    listed once even when prompts share a prefix.
    """

    fingerprint: str
    base_path: str
    block_hashes: tuple[list[bytes], ...]
    paths: list[str]

    def block_hashes_hex(self) -> list[list[str]]:
        """The `resolve` reply's `block_hashes`: lower-case hex per prompt."""
        return [[h.hex() for h in chain] for chain in self.block_hashes]


def parse_kv_request(
    message: Mapping[str, Any],
    profiles: Mapping[str, Profile],
    limits: Limits = Limits(),
    *,
    allow_inline: bool = True,
) -> KVRequest:
    """Validate a KV request map (the request's other keys, such as `op`, are ignored).

    `profiles` maps configured model names to profiles. `allow_inline=False` refuses
    inline hash/layout maps (a daemon may; `resolve` should always allow them).
    Raises KVRequestError naming the field; bounds exceeded carry code "too_large".
    """
    profile = _profile(message, profiles, allow_inline, limits)
    sources = [key for key in PROMPT_SOURCES if message.get(key) is not None]
    if len(sources) != 1:
        raise KVRequestError(
            "give exactly one of prompts, block_hashes (or a single prompt as request or "
            f"token_ids); got {', '.join(sources) if sources else 'none'}"
        )
    if sources[0] == "block_hashes":
        chains = _block_hashes(message["block_hashes"], limits)
        cost = _cost(profile, [len(chain) for chain in chains], limits)
        return KVRequest(profile, None, chains, *cost)
    if sources[0] == "prompts":
        raw = message["prompts"]
        if not isinstance(raw, Sequence) or isinstance(raw, str | bytes):
            raise KVRequestError("prompts: must be an array of prompt maps")
        if not raw:
            raise KVRequestError("prompts: must hold at least one prompt")
        _at_most(len(raw), limits.max_prompts, "prompts", "prompts")
        _check_tokens(raw, limits)
        prompts = tuple(
            _prompt(item, f"prompts[{i}]", None, profile, limits) for i, item in enumerate(raw)
        )
    else:
        single = message["request"] if sources[0] == "request" else message
        where = "request" if sources[0] == "request" else "token_ids"
        _check_tokens([single], limits)
        prompts = (_prompt(single, where, message, profile, limits),)
    cost = _cost(profile, [len(p.token_ids) // profile.hash_block_size for p in prompts], limits)
    return KVRequest(profile, prompts, None, *cost)


def resolve(request: KVRequest, *, fingerprint: str | None = None) -> Resolution:
    """Hash every prompt (each its own chain) and name every file. Pure: no I/O.

    `fingerprint` is required when the profile's is to be discovered
    (profile.needs_discovery) and overrides it otherwise.
    """
    profile = request.profile
    chosen = fingerprint or profile.fingerprint
    if chosen is None:
        raise KVRequestError(
            'layout.fingerprint is "discover": discover it first (kv.discover_fingerprint)'
        )
    if not FINGERPRINT_RE.fullmatch(chosen):
        raise KVRequestError(f"fingerprint: must be 12 lower-case hex digits, got {chosen!r}")
    if request.block_hashes is not None:
        chains = tuple(list(chain) for chain in request.block_hashes)
    else:
        assert request.prompts is not None
        chains = tuple(profile.hash_prompt(prompt) for prompt in request.prompts)
    base = profile.base_path(chosen)
    paths = layout.plan_paths(base, range(profile.rank_count), profile.group_factors, chains)
    return Resolution(fingerprint=chosen, base_path=base, block_hashes=chains, paths=paths)


# --- the profile --------------------------------------------------------------------------

def _profile(
    message: Mapping[str, Any], profiles: Mapping[str, Profile], allow_inline: bool,
    limits: Limits,
) -> Profile:
    name = message.get("model")
    inline = message.get("hash") is not None
    if name is not None:
        if inline:
            raise KVRequestError("give model or inline hash and layout, not both")
        if not isinstance(name, str):
            raise KVRequestError("model: must be the name of a configured profile (a string)")
        try:
            return profiles[name]
        except KeyError:
            known = ", ".join(sorted(profiles)) or "none configured"
            raise KVRequestError(f"model: no profile named {name!r} (known: {known})") from None
    if not inline:
        raise KVRequestError("model: missing (or give inline hash and layout maps)")
    if not allow_inline:
        raise KVRequestError(
            "hash/layout: inline profiles are refused by this daemon's configuration; "
            "name a configured model"
        )
    layout_map = message.get("layout")
    if layout_map is None and "root_dir" in message:
        layout_map = message  # the vectors' shape: layout keys beside the prompt
    if layout_map is None:
        raise KVRequestError("layout: missing (a map beside hash, or name a configured model)")
    return Profile.from_parts("inline", message["hash"], layout_map,
                              bounds=limits.profile_bounds)


def _check_tokens(prompts: Sequence[Any], limits: Limits) -> None:
    """The token bound, before any token is looked at (malformed prompts are left to
    the per-prompt checks)."""
    total = 0
    for item in prompts:
        token_ids = item.get("token_ids") if isinstance(item, Mapping) else None
        if isinstance(token_ids, list | tuple):
            total += len(token_ids)
    if total > limits.max_tokens:
        raise KVRequestError(
            f"token_ids: {total} tokens in the request, above the limit of {limits.max_tokens}",
            code="too_large",
        )


def _at_most(count: int, limit: int, where: str, what: str) -> None:
    """A count beyond its bound is `too_large`, naming the field and the limit."""
    if count > limit:
        raise KVRequestError(
            f"{where}: {count} {what}, above the limit of {limit}", code="too_large"
        )


def _cost(profile: Profile, hashes_per_prompt: list[int], limits: Limits) -> tuple[int, int, int]:
    """What resolving costs, refused beyond the limits: (blocks, files, plan bytes)."""
    blocks = sum(hashes_per_prompt)
    if blocks > limits.max_block_hashes:
        raise KVRequestError(
            f"the request holds {blocks} full blocks of {profile.hash_block_size} tokens to "
            f"hash, above the limit of {limits.max_block_hashes} (max_blocks)", code="too_large",
        )
    files = layout.count_files(hashes_per_prompt, profile.group_factors, profile.rank_count)
    if files > limits.max_files:
        raise KVRequestError(
            f"the request maps to {files} files ({profile.rank_count} ranks x "
            f"{len(profile.group_factors)} groups), above the limit of {limits.max_files}",
            code="too_large",
        )
    ls = profile.layout
    base_bytes = len(layout.base_path(ls.root_dir, ls.model_name, "0" * 12).encode())
    size = layout.plan_bytes(base_bytes, files, profile.rank_count, len(profile.group_factors))
    if size > limits.max_plan_bytes:
        raise KVRequestError(
            f"the request's {files} paths would take about {size} bytes, above the limit of "
            f"{limits.max_plan_bytes} (max_kv_path_bytes)", code="too_large",
        )
    return blocks, files, size


# --- prompts --------------------------------------------------------------------------

def _prompt(
    data: Any, where: str, outer: Mapping[str, Any] | None, profile: Profile, limits: Limits
) -> Prompt:
    if not isinstance(data, Mapping):
        raise KVRequestError(f"{where}: must be a map with token_ids")
    if data.get("prompt_embeds") is not None:
        raise KVRequestError(
            f"{where}.prompt_embeds: a prompt with embeddings is hashed over the embedding "
            "bytes, which the daemon does not have; it cannot be prefetched"
        )
    prefix = "" if where == "token_ids" else f"{where}."
    token_ids = _token_ids(data.get("token_ids"), f"{prefix}token_ids")
    salt = data.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise KVRequestError(f"{prefix}cache_salt: must be a string or nil")
    lora = _lora(data.get("lora"), f"{prefix}lora")
    mm = _mm_features(data.get("mm_features"), f"{prefix}mm_features", limits)
    explicit_raw = data.get("explicit_extra_keys")
    if explicit_raw is None and outer is not None and outer is not data:
        explicit_raw = outer.get("explicit_extra_keys")  # the vectors' shape
    explicit = None
    if explicit_raw is not None:
        if salt or lora is not None or mm:
            raise KVRequestError(
                f"{prefix}explicit_extra_keys: replaces the derived keys, so cache_salt, "
                "lora and mm_features must be absent"
            )
        explicit = _explicit_extra_keys(explicit_raw, f"{prefix}explicit_extra_keys")
        needed = len(token_ids) // profile.hash_block_size
        if len(explicit) < needed:
            raise KVRequestError(
                f"{prefix}explicit_extra_keys: {len(explicit)} entries for {needed} full "
                "blocks (one entry, or nil, per block)"
            )
    prompt = Prompt(
        token_ids=token_ids, cache_salt=salt, lora=lora, mm_features=mm,
        explicit_extra_keys=explicit,
    )
    profile.check_prompt(prompt, where)
    return prompt


def _token_ids(value: Any, where: str) -> Sequence[int]:
    if value is None:
        raise KVRequestError(f"{where}: missing (an array of token ids)")
    if not isinstance(value, list | tuple):
        raise KVRequestError(f"{where}: must be an array of token ids")
    if value:
        if set(map(type, value)) != {int}:
            raise KVRequestError(f"{where}: every token id must be an integer")
        if min(value) < 0 or max(value) > _U64:
            raise KVRequestError(f"{where}: token ids must lie in [0, 2**64)")
    return value


def _lora(value: Any, where: str) -> LoRA | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise KVRequestError(f"{where}: must be a map {{name, path}} or nil")
    name = value.get("name")
    path = value.get("path")
    if not isinstance(name, str):
        raise KVRequestError(f"{where}.name: must be the adapter's name (a string)")
    if path is not None and not isinstance(path, str):
        raise KVRequestError(f"{where}.path: must be a string")
    return LoRA(name=name, path=path)


def _mm_features(value: Any, where: str, limits: Limits) -> tuple[MMFeature, ...]:
    if value is None:
        return ()
    if not isinstance(value, list | tuple):
        raise KVRequestError(f"{where}: must be an array of {{identifier, offset, length}}")
    _at_most(len(value), limits.max_mm_features, where, "items")
    features = []
    previous_end = 0
    for index, item in enumerate(value):
        at = f"{where}[{index}]"
        if not isinstance(item, Mapping):
            raise KVRequestError(f"{at}: must be a map {{identifier, offset, length}}")
        identifier, offset, length = item.get("identifier"), item.get("offset"), item.get("length")
        if not isinstance(identifier, str):
            raise KVRequestError(f"{at}.identifier: must be vLLM's item hash (a string)")
        if type(offset) is not int or not 0 <= offset <= MAX_TOKEN_COUNT:
            raise KVRequestError(f"{at}.offset: must be an integer >= 0 and <= "
                                 f"{MAX_TOKEN_COUNT} (a token position)")
        if type(length) is not int or not 1 <= length <= MAX_TOKEN_COUNT:
            raise KVRequestError(f"{at}.length: must be an integer >= 1 and <= "
                                 f"{MAX_TOKEN_COUNT} (a count of tokens)")
        if offset < previous_end:
            raise KVRequestError(
                f"{at}.offset: items must be sorted by offset and must not overlap "
                "(vLLM's placeholder ranges are)"
            )
        previous_end = offset + length
        features.append(MMFeature(identifier=identifier, offset=offset, length=length))
    return tuple(features)


def _explicit_extra_keys(value: Any, where: str) -> tuple[BlockExtra, ...]:
    if not isinstance(value, list | tuple):
        raise KVRequestError(f"{where}: must be an array with one entry (array or nil) per block")
    blocks: list[BlockExtra] = []
    for index, entry in enumerate(value):
        at = f"{where}[{index}]"
        if entry is None:
            blocks.append(None)
        elif isinstance(entry, list | tuple):
            blocks.append(tuple(_extra_key(item, f"{at}[{i}]", 1) for i, item in enumerate(entry)))
        else:
            raise KVRequestError(f"{at}: must be an array of extra keys, or nil for none")
    return tuple(blocks)


def _extra_key(value: Any, where: str, depth: int) -> ExtraKey:
    """Typed JSON (tests/vectors/README.md): array -> CBOR array, string -> text,
    integer -> integer, {"bytes_hex": ...} (or a msgpack bin) -> byte string."""
    if isinstance(value, str | bytes):
        return value
    if type(value) is int:
        if not -(1 << 64) <= value <= _U64:
            raise KVRequestError(f"{where}: integers must fit CBOR's 64-bit range")
        return value
    if isinstance(value, list | tuple):
        if depth >= MAX_EXTRA_KEY_DEPTH:
            raise KVRequestError(f"{where}: nested deeper than {MAX_EXTRA_KEY_DEPTH} arrays")
        return tuple(_extra_key(item, f"{where}[{i}]", depth + 1) for i, item in enumerate(value))
    if isinstance(value, Mapping) and set(value) == {"bytes_hex"}:
        text = value["bytes_hex"]
        try:
            return bytes.fromhex(text)
        except (TypeError, ValueError):
            raise KVRequestError(f"{where}.bytes_hex: must be a hex string") from None
    raise KVRequestError(
        f"{where}: an extra key must be a string, an integer, an array or "
        '{"bytes_hex": ...}'
    )


def _block_hashes(value: Any, limits: Limits) -> tuple[tuple[bytes, ...], ...]:
    if not isinstance(value, list | tuple) or not value:
        raise KVRequestError("block_hashes: must be a non-empty array (per prompt) of arrays")
    _at_most(len(value), limits.max_prompts, "block_hashes", "prompts")
    chains = []
    total = 0
    for index, chain in enumerate(value):
        where = f"block_hashes[{index}]"
        if not isinstance(chain, list | tuple):
            raise KVRequestError(f"{where}: must be an array of 32-byte hashes")
        total += len(chain)
        if total > limits.max_block_hashes:
            raise KVRequestError(
                f"block_hashes: more than {limits.max_block_hashes} hashes in the request",
                code="too_large",
            )
        for position, item in enumerate(chain):
            if not isinstance(item, bytes) or len(item) != BLOCK_HASH_BYTES:
                raise KVRequestError(
                    f"{where}[{position}]: must be a {BLOCK_HASH_BYTES}-byte binary hash"
                )
        chains.append(tuple(chain))
    return tuple(chains)
