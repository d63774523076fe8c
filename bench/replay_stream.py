"""The router replay's request stream: Poisson arrivals, Zipf-popular prompts, shared prefixes.

What a router in front of vLLM's fs connector asks for (issue 25 item 1): a request is a chain
of KV block files, named as the connector names them (spec/kv-file-layout.md §5.1:
`<model>_<fp12>_r0/<h[0:3]>/<h[3:5]>_g0/<h>.bin`), each block's hash chained from the one
before it, so two prompts with the same beginning name the same leading files:

- a population of `docs` documents (conversations, RAG contexts), each a chain of
  `doc_blocks` blocks behind one of `systems` system prompts of `system_blocks` blocks:
  every request of a system prompt shares its leading files, every request of a document
  all of them (a repeated prompt);
- each request picks its document by Zipf(`zipf_s`) popularity (rank r has weight r^-s);
  its K = system_blocks + doc_blocks files are the system prompt's, then the document's;
- some files are warm before the stream starts: every system prompt's and those of
  `warm_share` of the documents, drawn by popularity (what earlier traffic left warm);
- arrivals are a Poisson process (exponential gaps); each request's consumer reads its
  files `delta` after arrival, delta uniform in [delta_min_ms, delta_max_ms] (routing and
  queueing before the GPU reads).

The load is set on the tier's fetch capacity: the stream of n requests over `duration_s`
brings F(n) files the tier has not fetched yet (first mentions, not warm); n is the least
count with F(n) >= load x capacity x duration_s, so the offered fetch rate is `load` times
what the tier can fetch. Everything is drawn from seeded generators: the same spec, load,
capacity and duration give the same stream, file for file and microsecond for microsecond.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

MODEL_DIR = "Qwen_Qwen3-8B_7d7b166f256e_r0"  # the connector's <safe_model>_<fp12>_r<rank>
MANIFEST = "replay-manifest.txt"


@dataclass(frozen=True)
class StreamSpec:
    """The population and the stream's shape (module docstring)."""

    seed: int = 1
    docs: int = 2000
    systems: int = 8
    system_blocks: int = 2
    doc_blocks: int = 6
    zipf_s: float = 1.0
    warm_share: float = 0.1
    delta_min_ms: float = 50.0
    delta_max_ms: float = 500.0
    file_bytes: int = 64 << 10

    @property
    def files_per_request(self) -> int:
        return self.system_blocks + self.doc_blocks


@dataclass(frozen=True)
class Request:
    index: int
    doc: int              # popularity rank, 0 the most popular
    system: int
    files: tuple[str, ...]  # relative to the root, the system prompt's first
    arrival_s: float      # from the stream's start
    delta_s: float        # the consumer reads at arrival_s + delta_s
    new: int = 0          # files no earlier request asked for and not warm: first mentions


@dataclass
class Stream:
    spec: StreamSpec
    load: float
    capacity: float       # files per second the tier fetches at most (measured)
    duration_s: float
    requests: list[Request]
    warm: list[str]       # files warm before the first request
    new_files: int        # files the stream needs fetched: first mentions, not warm
    offered: float = field(init=False)

    def __post_init__(self) -> None:
        self.offered = self.new_files / self.duration_s / self.capacity


def _chain(parent: str, label: str, count: int) -> list[str]:
    """`count` chained block hashes after `parent` (vLLM's: each hashes its parent's)."""
    hashes = []
    for index in range(count):
        parent = hashlib.sha256(f"{parent}/{label}/{index}".encode()).hexdigest()
        hashes.append(parent)
    return hashes


def _path(block_hash: str) -> str:
    return f"{MODEL_DIR}/{block_hash[:3]}/{block_hash[3:5]}_g0/{block_hash}.bin"


@dataclass
class Population:
    """Every file of the spec, by system prompt and by document (popularity rank)."""

    spec: StreamSpec
    system_files: list[list[str]]
    doc_files: list[list[str]]
    doc_system: list[int]
    weights: list[float]  # cumulative Zipf weights of the documents

    @classmethod
    def of(cls, spec: StreamSpec) -> Population:
        rng = random.Random(f"replay-population-{spec.seed}")
        sys_weights = [1 / (r + 1) for r in range(spec.systems)]
        roots = [_chain(f"seed{spec.seed}", f"system{g}", spec.system_blocks)
                 for g in range(spec.systems)]
        doc_system = rng.choices(range(spec.systems), sys_weights, k=spec.docs)
        doc_files = [[_path(h) for h in _chain(roots[g][-1], f"doc{d}", spec.doc_blocks)]
                     for d, g in enumerate(doc_system)]
        weights = list(itertools.accumulate((r + 1) ** -spec.zipf_s for r in range(spec.docs)))
        return cls(spec, [[_path(h) for h in chain] for chain in roots], doc_files,
                   doc_system, weights)

    def files(self) -> list[str]:
        return sorted({f for chain in (*self.system_files, *self.doc_files) for f in chain})

    def request_files(self, doc: int) -> tuple[str, ...]:
        return (*self.system_files[self.doc_system[doc]], *self.doc_files[doc])

    def draw(self, rng: random.Random) -> int:
        """One document by popularity."""
        return bisect.bisect_left(self.weights, rng.random() * self.weights[-1])

    def warm_files(self) -> list[str]:
        """What earlier traffic left warm: every system prompt, warm_share of the documents
        drawn by popularity."""
        rng = random.Random(f"replay-warm-{self.spec.seed}")
        wanted = round(self.spec.warm_share * self.spec.docs)
        docs: set[int] = set()
        while len(docs) < wanted:
            docs.add(self.draw(rng))
        return sorted({f for chain in self.system_files for f in chain}
                      | {f for d in docs for f in self.doc_files[d]})


def stream(spec: StreamSpec, load: float, capacity: float, duration_s: float) -> Stream:
    """The requests for one load (module docstring); the same for the same arguments."""
    population = Population.of(spec)
    warm = population.warm_files()
    seen = set(warm)
    target = load * capacity * duration_s
    choose = random.Random(f"replay-docs-{spec.seed}")  # the same prefix for every load
    docs: list[int] = []
    firsts: list[int] = []
    new = 0
    while new < target:
        if len(docs) > 100 * spec.docs:
            raise ValueError(f"the population ({spec.docs} documents) cannot supply "
                             f"{target:.0f} new files: raise docs or lower the duration")
        doc = population.draw(choose)
        docs.append(doc)
        before = new
        for path in population.request_files(doc):
            if path not in seen:
                seen.add(path)
                new += 1
        firsts.append(new - before)
    arrivals = random.Random(f"replay-arrivals-{spec.seed}-{load}")
    deltas = random.Random(f"replay-deltas-{spec.seed}")
    rate = len(docs) / duration_s
    now, requests = 0.0, []
    for index, doc in enumerate(docs):
        now += arrivals.expovariate(rate)
        delta = deltas.uniform(spec.delta_min_ms, spec.delta_max_ms) / 1000
        requests.append(Request(index, doc, population.doc_system[doc],
                                population.request_files(doc), now, delta, firsts[index]))
    return Stream(spec, load, capacity, duration_s, requests, warm, new)


def ensure_backing(spec: StreamSpec, base: Path) -> Path:
    """The population's files under base/replay-<key>, written once (real, varied bytes:
    no holes a tier could serve without reading); the directory."""
    key = hashlib.sha256(f"{spec.seed}-{spec.docs}-{spec.systems}-{spec.system_blocks}-"
                         f"{spec.doc_blocks}-{spec.file_bytes}".encode()).hexdigest()[:12]
    root = base / f"replay-{key}"
    if (root / MANIFEST).exists():
        return root
    pool = random.Random(f"replay-bytes-{spec.seed}").randbytes(spec.file_bytes + 4096)
    files = Population.of(spec).files()
    for number, rel in enumerate(files):
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        shift = (number * 64) % 4096
        stamp = f"{number:012d}{rel[-20:]}".encode()
        path.write_bytes(stamp + pool[shift + len(stamp) : shift + spec.file_bytes])
    (root / MANIFEST).write_text(f"{len(files)} files of {spec.file_bytes} bytes\n")
    return root


def paths_under(root: Path | str, files: Sequence[str]) -> list[str]:
    return [os.path.join(root, f) for f in files]
