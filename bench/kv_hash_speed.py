"""What a KV request costs the single-threaded supervisor: µs per 1,000 tokens.

For 32k-token prompts (token ids drawn from a 152k vocabulary, as Qwen's), block sizes
16 and 64, without extra keys and with the heaviest common ones (era C: LoRA on every
block, cache_salt on block 0, a multimodal item every 2k tokens):
- hash: kv.hashing.prompt_block_hashes alone (cbor2 + SHA-256 per block);
- resolve: the whole op as the supervisor runs it, parse_kv_request + resolve, paths for
  tp=2 and 256-token files included (validation of the token ids is part of it).

Each figure is the median and the minimum of --reps timed runs (one prompt each); the
machine's other load shows as a gap between the two. The result is one JSON document.

    .venv/bin/python bench/kv_hash_speed.py [--tokens 32768] [--reps 30]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from functools import partial
from typing import Any

import cbor2

from kvprefetchd import kv
from kvprefetchd.kv import hashing

VOCAB = 152_000


def prompt_map(tokens: list[int], extras: bool) -> dict[str, Any]:
    prompt: dict[str, Any] = {"token_ids": tokens}
    if extras:
        prompt["cache_salt"] = "tenant-a"
        prompt["lora"] = {"name": "sql-lora", "path": "/adapters/sql-lora"}
        prompt["mm_features"] = [
            {"identifier": f"{i:064x}", "offset": offset, "length": 576}
            for i, offset in enumerate(range(100, len(tokens) - 600, 2048))
        ]
    return prompt


def profile_tables(block_size: int) -> dict[str, Any]:
    return {
        "hash": {"algo": "sha256_cbor", "python_hash_seed": "0", "block_size": block_size,
                 "vllm_version": "0.34.0"},
        "layout": {"root_dir": "/mnt/kv", "model_name": "Qwen/Qwen3-8B", "tp_size": 2,
                   "kv_cache_groups": [{"block_size": block_size}],
                   "connector_block_size_tokens": 256, "fingerprint": "0123456789ab"},
    }


def resolve_message(message: dict[str, Any], profiles: dict[str, kv.Profile]) -> None:
    kv.resolve(kv.parse_kv_request(message, profiles))


def timed(action: Any, reps: int) -> list[float]:
    action()  # warm: imports, caches
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        action()
        samples.append(time.perf_counter() - start)
    return samples


def summary(samples: list[float], tokens: int) -> dict[str, float]:
    per_k = [s / tokens * 1000 * 1e6 for s in samples]
    return {"us_per_1k_tokens_median": round(statistics.median(per_k), 1),
            "us_per_1k_tokens_min": round(min(per_k), 1),
            "ms_per_prompt_median": round(statistics.median(samples) * 1e3, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32_768)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    tokens = [rng.randrange(VOCAB) for _ in range(args.tokens)]
    results = []
    for block_size in (16, 64):
        profiles = {"m": kv.Profile.from_mapping("m", profile_tables(block_size))}
        profile = profiles["m"]
        for extras in (False, True):
            message = {"model": "m", "prompts": [prompt_map(tokens, extras)]}
            request = kv.parse_kv_request(message, profiles)
            assert request.prompts is not None
            prompt = request.prompts[0]
            assert profile.none_hash is not None
            hash_only = partial(hashing.prompt_block_hashes, prompt,
                                hash_block_size=profile.hash_block_size,
                                parent=profile.none_hash, era=profile.era)
            whole_op = partial(resolve_message, message, profiles)
            files = len(kv.resolve(request).paths)
            for name, action in (("hash", hash_only), ("resolve", whole_op)):
                results.append({
                    "what": name, "block_size": block_size, "extras": extras,
                    "tokens": args.tokens, "blocks": args.tokens // block_size,
                    "files": files if name == "resolve" else None,
                    **summary(timed(action, args.reps), args.tokens),
                })
    print(json.dumps({
        "bench": "kv_hash_speed",
        "python": platform.python_version(),
        "cbor2": getattr(cbor2, "__version__", None) or _dist_version("cbor2"),
        "cbor2_c_extension": _cbor2_is_native(),
        "machine": platform.machine(),
        "reps": args.reps,
        "results": results,
    }, indent=2))


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _cbor2_is_native() -> bool:
    """cbor2 falls back to pure Python (several times slower) without its C extension."""
    return "_cbor2" in sys.modules or type(cbor2.dumps).__name__ == "builtin_function_or_method"


if __name__ == "__main__":
    main()
