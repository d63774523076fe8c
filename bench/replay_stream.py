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

The load is set on the tier's measured work: a file the tier has not fetched yet (a first
mention, not warm) costs it 1/capacity seconds, as a cold read by many threads at once
measured it; every other file a consumer opens costs it 1/warm_capacity, as the same
reads of warm files measured it. On the simulator that second cost is next to nothing (an
open is a local call); on s3fs it is not: every open of a file nobody has open sends the
endpoint two HEADs (measured: warm files open and read at 5-7 times the cold rate, so
each counts for about a sixth of a fetch). The stream of n requests over `duration_s` is
the least n whose work W(n) >= load x duration_s: the offered load is `load` times what the
tier can serve, whatever its work is made of. Everything is drawn from seeded generators:
the same spec, load, capacity, warm capacity and duration give the same stream, file for
file and microsecond for microsecond.
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
    warm_capacity: float = 0.0  # warm files per second the tier opens at most (0: free)
    offered: float = field(init=False)  # the stream's work over the tier's, per second

    def __post_init__(self) -> None:
        opens = sum(len(r.files) for r in self.requests) - self.new_files
        work = self.new_files / self.capacity
        if self.warm_capacity > 0:
            work += opens / self.warm_capacity
        self.offered = work / self.duration_s


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


def stream(spec: StreamSpec, load: float, capacity: float, duration_s: float,
           warm_capacity: float = 0.0) -> Stream:
    """The requests for one load (module docstring); the same for the same arguments.
    warm_capacity 0: a warm file's open costs the tier nothing."""
    population = Population.of(spec)
    warm = population.warm_files()
    seen = set(warm)
    target = load * duration_s  # seconds of the tier's work
    open_cost = 1 / warm_capacity if warm_capacity > 0 else 0.0
    choose = random.Random(f"replay-docs-{spec.seed}")  # the same prefix for every load
    docs: list[int] = []
    firsts: list[int] = []
    new, work = 0, 0.0
    while work < target:
        if len(docs) > 100 * spec.docs:
            raise ValueError(f"the population ({spec.docs} documents) cannot supply "
                             f"{target:.1f} s of the tier's work: raise docs or lower the "
                             "duration")
        doc = population.draw(choose)
        docs.append(doc)
        before = new
        for path in population.request_files(doc):
            if path not in seen:
                seen.add(path)
                new += 1
                work += 1 / capacity
            else:
                work += open_cost
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
    return Stream(spec, load, capacity, duration_s, requests, warm, new, warm_capacity)


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
