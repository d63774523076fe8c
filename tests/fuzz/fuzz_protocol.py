"""A coverage-guided fuzz target (atheris, libFuzzer) for the supervisor's request path.

The contract is protocol_target.py's, the same the hypothesis properties check: every
frame gets one well-formed reply with a documented error code, never `internal`. What
libFuzzer adds is coverage feedback: it keeps inputs that reach new branches of the
framing, the decoder, each op's validation, confinement and the KV parser.

    .venv/bin/pip install atheris          # optional: not a project dependency
    mkdir -p /tmp/kvcorpus && cp tests/corpus/frames/*.bin /tmp/kvcorpus/
    .venv/bin/python tests/fuzz/fuzz_protocol.py -max_total_time=600 /tmp/kvcorpus

An input's first byte chooses its shape, so both the framing and what lies behind it
get explored: odd, the rest is one frame's body (msgpack, or not); even, the rest is
a raw byte stream. The byte also sets the size of the reads the stream arrives in.
Each input gets a fresh connection (a stream may leave the last one mid-skip).
Without atheris, `check` replays inputs (tests/fuzz/test_fuzz_protocol.py does).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

if __name__ == "__main__":
    import atheris

    # Run as a script, outside pytest and its `pythonpath`: the harness is in bench/.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    # Only the daemon's code and the checker: instrument_all() would add ~5,600 stdlib
    # functions (25 s to instrument) whose edges are noise to the search.
    with atheris.instrument_imports(include=["kvprefetchd", "protocol_target"]):
        from protocol_target import SMALL_LIMITS, InProcessSupervisor
else:
    from protocol_target import SMALL_LIMITS, InProcessSupervisor

from kvharness.wire import frame

_target: InProcessSupervisor | None = None


def target() -> InProcessSupervisor:
    global _target
    if _target is None:
        _target = InProcessSupervisor(**SMALL_LIMITS)
    return _target


def check(data: bytes) -> None:
    """Raise (ContractError or whatever escaped) if the daemon's answer breaks the contract."""
    if not data:
        return
    shape, rest = data[0], data[1:]
    stream = frame(rest) if shape & 1 else rest
    read_size = 1 + (shape >> 1) * 4  # 1..509 bytes per read
    cuts = range(read_size, len(stream), read_size)
    supervisor = target()
    supervisor.reset_stream()
    supervisor.stream(stream, cuts)
    if supervisor.internal_errors():
        raise AssertionError(f"internal errors: {dict(supervisor.supervisor.ops.requests)}")


def main(argv: Sequence[str]) -> None:
    atheris.Setup(list(argv), check)
    atheris.Fuzz()


if __name__ == "__main__":
    main(sys.argv)
