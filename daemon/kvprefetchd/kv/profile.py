"""A model profile: how one vLLM deployment hashes blocks and where its connector writes them.

Built from a `[models.NAME]` table of the daemon's configuration, or from the inline
`hash` and `layout` maps of a KV request; both use the key names of the wire protocol
(docs/protocol.md, "KV requests"), which are the spec's and the golden vectors':

    [models.qwen3-8b.hash]
    algo = "sha256_cbor"          # or "sha256" (vLLM's default, pickle)
    python_hash_seed = "10"       # PYTHONHASHSEED of vLLM; leave out when unset
    block_size = 64               # vLLM --block-size ("vllm_block_size" also accepted)
    vllm_version = "0.23.0"       # selects the extra-key era and the unset-seed rule
    # hash_block_size_tokens = 64 # only for hybrid models whose H is not the gcd

    [models.qwen3-8b.layout]
    root_dir = "/mnt/kv"          # the connector's shared_storage_path
    model_name = "Qwen/Qwen3-8B"  # vLLM --model exactly as given
    tp_size = 1                   # pp_size, pcp_size, dcp_size: default 1
    connector_block_size_tokens = 512   # default 256, the connector's default
    kv_cache_groups = [{ block_size = 64, layer_names = ["model.layers.0.self_attn.attn"] }]
    # fingerprint = "07d7b166f256" | "discover"; fingerprint_fields = {...}

Everything derivable is derived once here (hash block size, blocks per file, per-group
factors, ranks, fingerprint, NONE_HASH) so a request costs only its hashing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kvprefetchd.kv import hashing, layout
from kvprefetchd.kv.errors import KVRequestError, ProfileError
from kvprefetchd.kv.hashing import Era, Prompt, Version
from kvprefetchd.kv.layout import FieldSet
from kvprefetchd.kv.specs import (
    DISCOVER,
    HashSpec,
    KVCacheGroup,
    LayoutSpec,
    ProfileBounds,
    as_mapping,
    read_hash_spec,
    read_layout_spec,
    refuse_unknown,
)

__all__ = ["DISCOVER", "HashSpec", "KVCacheGroup", "LayoutSpec", "Profile", "ProfileBounds"]


@dataclass(frozen=True)
class Profile:
    """A validated profile and what it implies. Build it with `from_mapping` or `build`.

    `fingerprint` is None only when the layout asks to discover it on disk
    (kv.discover.discover_fingerprint). `none_hash` is None when the seed cannot be
    reproduced (`seed_problem` says why): such a profile still serves block_hashes.
    """

    name: str
    hash: HashSpec
    layout: LayoutSpec
    version: Version | None
    era: Era | None
    hash_block_size: int
    blocks_per_file: int
    group_factors: tuple[int, ...]
    rank_count: int
    field_set: FieldSet
    fingerprint: str | None
    none_hash: bytes | None
    seed_problem: str | None

    # --- construction ---------------------------------------------------------------

    @classmethod
    def from_mapping(
        cls, name: str, table: Mapping[str, Any], *, prefix: str | None = None,
        strict: bool = True,
    ) -> Profile:
        """From a `[models.NAME]` table: {"hash": {...}, "layout": {...}}.

        Errors name the key as `models.NAME.layout.tp_size` (or with `prefix`).
        `strict` refuses unknown keys (a typo in a config file must not pass silently).
        """
        where = f"models.{name}." if prefix is None else prefix
        table = as_mapping(table, where.rstrip(".") or "profile")
        if strict:
            refuse_unknown(table, frozenset({"hash", "layout"}), where)
        if "hash" not in table:
            raise ProfileError(f"{where}hash: missing (a map of how vLLM hashes blocks)")
        if "layout" not in table:
            raise ProfileError(f"{where}layout: missing (a map of where the connector writes)")
        return cls.from_parts(
            name, table["hash"], table["layout"], prefix=where, strict=strict
        )

    @classmethod
    def from_parts(
        cls, name: str, hash_map: Any, layout_map: Any, *, prefix: str = "",
        strict: bool = False, bounds: ProfileBounds | None = None,
    ) -> Profile:
        """From separate hash and layout maps (an inline KV request uses this, with the
        daemon's `bounds`: beyond them it is `too_large` before anything is derived)."""
        return cls.build(
            name,
            read_hash_spec(hash_map, f"{prefix}hash", strict),
            read_layout_spec(layout_map, f"{prefix}layout", strict, bounds),
            prefix=prefix,
            bounds=bounds,
        )

    @classmethod
    def build(
        cls, name: str, hash_spec: HashSpec, layout_spec: LayoutSpec, *, prefix: str = "",
        bounds: ProfileBounds | None = None,
    ) -> Profile:
        """Derive and cross-check everything the two specs imply."""
        try:
            return cls._derive(name, hash_spec, layout_spec, prefix, bounds)
        except ValueError as error:
            if isinstance(error, ProfileError):
                raise
            raise ProfileError(f"{prefix}{error}") from None

    @classmethod
    def _derive(
        cls, name: str, hs: HashSpec, ls: LayoutSpec, prefix: str, bounds: ProfileBounds | None
    ) -> Profile:
        positive = {"hash.block_size": hs.block_size, "layout.tp_size": ls.tp_size,
                    "layout.pp_size": ls.pp_size, "layout.pcp_size": ls.pcp_size,
                    "layout.dcp_size": ls.dcp_size,
                    "layout.connector_block_size_tokens": ls.connector_block_size_tokens,
                    **{f"layout.kv_cache_groups[{i}].block_size": g.block_size
                       for i, g in enumerate(ls.kv_cache_groups)}}
        for key, value in positive.items():
            if value < 1:
                raise ProfileError(f"{prefix}{key}: must be a positive integer, got {value}")
        if not ls.kv_cache_groups:
            raise ProfileError(f"{prefix}layout.kv_cache_groups: must not be empty")
        rank_count = layout.rank_count(
            ls.tp_size, ls.pp_size, ls.pcp_size, parallel_agnostic=ls.parallel_agnostic
        )
        if bounds is not None:
            _check_bounds(ls, rank_count, bounds, prefix)
        version = None
        if hs.vllm_version is not None:
            try:
                version = hashing.parse_vllm_version(hs.vllm_version)
            except ValueError as error:
                raise ProfileError(f"{prefix}hash.vllm_version: {error}") from None
        if ls.tp_size % ls.dcp_size:
            raise ProfileError(
                f"{prefix}layout.dcp_size ({ls.dcp_size}) must divide layout.tp_size "
                f"({ls.tp_size}): decode context parallelism reuses the tp ranks"
            )
        sizes = [group.block_size for group in ls.kv_cache_groups]
        if len(sizes) == 1 and sizes[0] != hs.block_size:
            raise ProfileError(
                f"{prefix}layout.kv_cache_groups[0].block_size ({sizes[0]}) must equal "
                f"hash.block_size ({hs.block_size}) for a single-group model"
            )
        h = hashing.hash_block_size(
            hs.block_size, sizes, dcp_size=ls.dcp_size, pcp_size=ls.pcp_size,
            configured=hs.hash_block_size_tokens,
        )
        per_file = layout.gpu_blocks_per_file(ls.connector_block_size_tokens, h)
        factors = layout.group_factors(
            sizes, hash_block_size=h, blocks_per_file=per_file, dcp_size=ls.dcp_size,
            pcp_size=ls.pcp_size,
        )
        field_set = ls.fingerprint_field_set or layout.field_set_for(version)
        none_hash = seed_problem = None
        try:
            seed = hashing.seed_string(hs.python_hash_seed, version)
            none_hash = hashing.none_hash(seed, hs.algo)
        except KVRequestError as error:
            seed_problem = error.message
        profile = cls(
            name=name, hash=hs, layout=ls, version=version,
            era=hashing.era_of(version) if version is not None else None,
            hash_block_size=h, blocks_per_file=per_file, group_factors=factors,
            rank_count=rank_count, field_set=field_set, fingerprint=None,
            none_hash=none_hash, seed_problem=seed_problem,
        )
        return replace(profile, fingerprint=_choose_fingerprint(profile, prefix))

    # --- what a request needs -------------------------------------------------------

    @property
    def needs_discovery(self) -> bool:
        return self.fingerprint is None

    @property
    def ranks(self) -> range:
        return range(self.rank_count)

    def base_path(self, fingerprint: str | None = None) -> str:
        chosen = fingerprint or self.fingerprint
        if chosen is None:
            raise KVRequestError(
                'layout.fingerprint is "discover" and no fingerprint was discovered yet'
            )
        return layout.base_path(self.layout.root_dir, self.layout.model_name, chosen)

    def check_prompt(self, prompt: Prompt, where: str = "prompt") -> None:
        """Refuse, before any work, a prompt this profile cannot hash exactly."""
        if self.none_hash is None:
            raise KVRequestError(self.seed_problem or "hash.python_hash_seed: unusable")
        if prompt.explicit_extra_keys is None and prompt.has_derived_extras:
            if self.era is None:
                raise KVRequestError(
                    f"{where}: cache_salt, lora and mm_features need hash.vllm_version "
                    "(the shape of their keys changed across vLLM releases)"
                )
            if self.era == "C" and prompt.lora is not None and prompt.lora.path is None:
                raise KVRequestError(
                    f"{where}.lora.path: required on vLLM >= 0.31, which hashes the path"
                )

    def hash_prompt(self, prompt: Prompt) -> list[bytes]:
        """The prompt's block hashes, each prompt its own chain from NONE_HASH."""
        self.check_prompt(prompt)
        assert self.none_hash is not None
        return hashing.prompt_block_hashes(
            prompt, hash_block_size=self.hash_block_size, parent=self.none_hash,
            era=self.era, algo=self.hash.algo,
        )

    # --- fingerprint ----------------------------------------------------------------

    def fingerprint_fields(self) -> dict[str, Any] | None:
        """The field map this profile's writer hashes, or None if layer names are unknown."""
        ls = self.layout
        groups = []
        for group in ls.kv_cache_groups:
            if group.layer_names is None:
                return None
            groups.append((group.block_size, group.layer_names))
        return layout.fingerprint_fields(
            field_set=self.field_set, model_name=ls.model_name, block_size=self.hash.block_size,
            blocks_per_file=self.blocks_per_file, tp_size=ls.tp_size, pp_size=ls.pp_size,
            pcp_size=ls.pcp_size, dcp_size=ls.dcp_size, dtype=ls.dtype, kv_cache_groups=groups,
            parallel_agnostic=ls.parallel_agnostic, replicated_layout=ls.replicated_layout,
            canonical_format=ls.canonical_format,
        )

    def computed_fingerprint(self) -> str | None:
        """The fingerprint implied by the profile's own fields (None if not computable)."""
        if self.layout.fingerprint_fields_json is not None:
            return layout.fingerprint_of_json(self.layout.fingerprint_fields_json)
        fields = self.fingerprint_fields()
        return layout.fingerprint_of(fields) if fields is not None else None


def _check_bounds(ls: LayoutSpec, rank_count: int, bounds: ProfileBounds, prefix: str) -> None:
    """Every size within max_ranks (dcp too: it must divide tp), and the world they make."""
    for key in ("tp_size", "pp_size", "pcp_size", "dcp_size"):
        value = getattr(ls, key)
        if value > bounds.max_ranks:
            raise ProfileError(
                f"{prefix}layout.{key}: {value}, above the limit of {bounds.max_ranks} ranks "
                "(max_ranks)", code="too_large",
            )
    if rank_count > bounds.max_ranks:
        raise ProfileError(
            f"{prefix}layout: tp_size x pp_size x pcp_size is {rank_count} ranks, above the "
            f"limit of {bounds.max_ranks} (max_ranks)", code="too_large",
        )
    if len(ls.kv_cache_groups) > bounds.max_kv_cache_groups:
        raise ProfileError(
            f"{prefix}layout.kv_cache_groups: {len(ls.kv_cache_groups)} groups, above the "
            f"limit of {bounds.max_kv_cache_groups} (max_kv_cache_groups)", code="too_large",
        )


def _choose_fingerprint(profile: Profile, prefix: str) -> str | None:
    given = profile.layout.fingerprint
    from_fields = (
        layout.fingerprint_of_json(profile.layout.fingerprint_fields_json)
        if profile.layout.fingerprint_fields_json is not None else None
    )
    if given == DISCOVER:
        if from_fields is not None:
            raise ProfileError(
                f'{prefix}layout.fingerprint: "discover" contradicts the given '
                "layout.fingerprint_fields; give one of them"
            )
        return None
    if given is not None:
        if from_fields is not None and from_fields != given:
            raise ProfileError(
                f"{prefix}layout.fingerprint_fields hash to {from_fields}, not to "
                f"layout.fingerprint {given}"
            )
        return given
    if from_fields is not None:
        return from_fields
    computed = profile.computed_fingerprint()
    if computed is None:
        missing = next(
            i for i, g in enumerate(profile.layout.kv_cache_groups) if g.layer_names is None
        )
        raise ProfileError(
            f"{prefix}layout.kv_cache_groups[{missing}].layer_names: needed to compute the "
            'folder fingerprint; give them, or layout.fingerprint (12 hex, or "discover")'
        )
    return computed
