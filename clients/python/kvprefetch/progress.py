"""What a bulk run shows while it runs: a line redrawn on a terminal, a line now and then
anywhere else.

A `warm --wait` over a slow tier can take minutes (1,000 files at 25 a second: issue 24),
and its replies come a batch (up to 1,024 files) at a time: between them the figure comes
from the daemon's own counters (kvprefetch.liveness asks for them), so the line moves with
the work. A terminal gets one line, redrawn at most every REDRAW_EVERY_S; a log or a CI job
gets one full line every `every_s` seconds, the first only once the run has lasted that
long: a short run writes nothing there, a long one a line per interval, never a line per
batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import IO

REDRAW_EVERY_S = 0.2
LINES_EVERY_S = 30.0  # off a terminal, unless --progress says otherwise


@dataclass(frozen=True, slots=True)
class Figures:
    """Where a bulk run stands, as Bulk.figures() sees it."""

    op: str  # warm, check or evict
    verb: str  # what `done` counts: settled (a reply or a state), or queued (fire and forget)
    done: int
    about: bool  # `done` includes the daemon's counters: not yet confirmed by a reply
    listed: int  # paths read from the input so far
    listed_all: bool  # the input is read to its end
    in_flight: int  # files sent and not settled yet (as far as `done` knows)
    retried: int  # sends of a file again after a full queue
    elapsed_s: float
    idle_s: float  # since `done` last grew


class Progress:
    """Writes Figures to `stream`: `redraw` for a terminal (one line, `\\r` first), else a
    line per `every_s`."""

    def __init__(self, stream: IO[str], *, redraw: bool, every_s: float = REDRAW_EVERY_S
                 ) -> None:
        self.stream = stream
        self.redraw = redraw
        self.every_s = every_s
        self._shown = 0.0 if redraw else time.monotonic()

    def show(self, figures: Figures, final: bool = False) -> None:
        """At most once per interval; `final` always redraws a terminal's line and ends it,
        and writes nothing elsewhere (the summary follows on stdout)."""
        if final and not self.redraw:
            return
        now = time.monotonic()
        if not final and now - self._shown < self.every_s:
            return
        self._shown = now
        line = describe(figures, clock=not self.redraw)
        if self.redraw:
            # Erase what a longer line before left (ECMA-48 EL: to the end of the line).
            self.stream.write("\r" + line + "\x1b[K" + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def describe(figures: Figures, *, clock: bool) -> str:
    """`kvprefetch warm: 412 of 1,000 files settled (25/s), 588 in flight`; `clock` adds
    the time so far and how long nothing settled, for a log read later."""
    total = f"{figures.listed:,}" + ("" if figures.listed_all else "+")
    rate = figures.done / max(figures.elapsed_s, 1e-6)
    line = (f"kvprefetch {figures.op}: {'about ' if figures.about else ''}{figures.done:,} "
            f"of {total} files {figures.verb} ({rate:,.0f}/s)")
    if figures.in_flight and clock:
        line += f", {figures.in_flight:,} in flight"
    if figures.retried:
        line += f", {figures.retried:,} resent after a full queue"
    if clock:
        line += f", {figures.elapsed_s:.0f} s"
        if figures.in_flight and figures.idle_s >= 10:
            line += f" (none settled in the last {figures.idle_s:.0f} s)"
    return line
