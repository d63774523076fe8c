"""What a warm-up leaves for the consumer, per root: one worker's judge of it.

A file read is warm only if a fresh open by another process finds it so (docs/tiers.md).
Per root the tier profile says how that can be (RootTier.keep): the page cache, the file
held open (holds.py), the file system's disk cache (fscache.py), or not known, found out
by reopening (reopen.py). The worker asks three things of it:
- `judged`: a file just read: `read`, or `futile` where the consumer will not find it;
- `found_warm`: a file found warm on a hold root, held for its consumer all the same;
- `known_state`: what `check` says of a file without an open where an open would undo a
  warm-up (a held file, a disk-cached copy, a futile root);
- `skip`: whether a file needs no read (held, or in the disk cache) or a lookup only (a
  futile root: nothing read there would reach the consumer).
"""

from __future__ import annotations

from collections.abc import Hashable

from kvprefetchd.channel import RootTier
from kvprefetchd.engines.base import Completion, WarmItem
from kvprefetchd.native import Native
from kvprefetchd.roots.fscache import FsCacheView, warm_enough
from kvprefetchd.worker.holds import HoldBudget, Holds
from kvprefetchd.worker.inspection import Inspector, Look
from kvprefetchd.worker.reopen import Verdicts


class Keeping:
    def __init__(self, native: Native, budget: HoldBudget, inspector: Inspector) -> None:
        self._lib = native.lib
        self.holds = Holds(native, max_files=budget.max_files, max_bytes=budget.max_bytes,
                           seconds=budget.seconds)
        self.verdicts = Verdicts()
        self.fscache = FsCacheView()
        self._inspector = inspector
        self.reported = (0, 0)  # held files and bytes as the supervisor last heard

    @property
    def hold_flag(self) -> int:
        """KVP_ITEM_HOLD where holding is on (a budget), else 0."""
        return int(self._lib.KVP_ITEM_HOLD) if self.holds.enabled else 0

    @property
    def holding(self) -> tuple[int, int]:
        return len(self.holds), self.holds.bytes

    @property
    def holding_changed(self) -> bool:
        """The held files' gauge is not what the supervisor last heard."""
        return self.holds.enabled and self.reported != self.holding

    def skip(self, root_index: int, tier: RootTier, relative: bytes, span: int) -> str:
        """"resident" (no read needed), "metadata" (a futile root's: no data read is worth
        a fetch, but its lookup is) or "" (read it)."""
        if tier.fs_cache:
            copy = self.fscache.cached(tier.fs_cache, relative)
            if copy is not None and warm_enough(copy[0], copy[1], span):
                return "resident"
        verdicts = self.verdicts
        if verdicts.dropped(root_index) and not verdicts.wants_look(root_index):
            # The file's lookup and attributes still reach the consumer where the file
            # system caches them (rclone's directory cache: the consumer's open then sends
            # no HEAD, 2.8 s instead of 4.2 s for 60 files here); its data would not. One
            # file is read again when the verdict is due to be looked at anew.
            return "metadata"
        return ""

    def known_state(self, key: Hashable, root_index: int, relative: bytes, tier: RootTier,
                    span: int) -> Look | None:
        """What a look would find of a file, said without an open; None: look
        (kvp_inspect)."""
        held = self.holds.held(key)
        if held is not None:
            return Look("resident", 0, held.size, held.size, 0)
        if tier.fs_cache:
            copy = self.fscache.cached(tier.fs_cache, relative)
            if copy is not None:
                size, on_disk = copy
                state = "resident" if warm_enough(size, on_disk, span) else "cold"
                return Look(state, 0, size, 0, on_disk)
        if self.verdicts.dropped(root_index):
            return Look("futile", 0, 0, 0, 0)
        if tier.keep == "hold":  # only an open could tell, and it would be the consumer's
            return Look("cold", 0, 0, 0, 0)
        return None

    def judged(self, completion: Completion, root_index: int, tier: RootTier) -> str:
        """A file read, judged where its consumer will read it: `read` when a fresh open
        by another process would find it warm (its root keeps the page cache, its file
        system's own cache has it, or it is held open for the consumer), else `futile`."""
        item = completion.item
        if completion.held_fd >= 0:
            held = self.holds.hold(item.key, completion.held_fd, completion.size)
            return "read" if held or tier.keep != "hold" else "futile"
        if tier.keep == "hold":  # not held: an engine that cannot hold, or no budget
            return "futile"
        if tier.keep != "probe":
            return "read"
        verdicts = self.verdicts
        if completion.done > 0 and verdicts.wants_look(root_index):
            warm = self.still_warm(item, completion.done)
            if warm is not None:
                verdicts.looked(root_index, warm)
                if not warm:
                    return "futile"  # this very file was found cold: never `read`
        return "futile" if verdicts.dropped(root_index) else "read"

    def found_warm(self, completion: Completion) -> None:
        """Hold a file found warm on a hold root: the consumer's open finds it open, which
        on s3fs spares that open its HEAD (measured here, 10 ms each way to the endpoint:
        0.1 ms a file held against 47 ms warm but let go, as long as a cold read)."""
        self.holds.hold(completion.item.key, completion.held_fd, completion.size)

    def still_warm(self, item: WarmItem, read: int) -> bool | None:
        """Open the file anew, as its consumer will, and look at its pages: warm when at
        least half of what was read is still there (the host's reclaimer takes a few
        percent of fresh pages); None when the look failed."""
        look, = self._inspector.look(
            self._lib.KVP_INSPECT_CHECK,
            [WarmItem(item.root_fd, item.rule, item.relative, item.read_bytes)], False)
        if look.state not in ("resident", "cold"):
            return None
        return look.cached * 2 >= read

    def gauge(self) -> dict[str, int]:
        """The held files' gauge for a report (remembered as heard)."""
        if not self.holds.enabled:
            return {}
        self.reported = self.holding
        return {"held_files": self.reported[0], "held_bytes": self.reported[1]}
