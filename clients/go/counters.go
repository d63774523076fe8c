package kvprefetch

import "sync/atomic"

// Counters is a snapshot of what the client did. Fire-and-forget calls return before the
// daemon answers, so this is where their fate shows: each is Dropped or Sent, and each
// Sent one ends as Acked, Refused or Lost (or is still in flight).
type Counters struct {
	// Fire-and-forget requests (Prefetch and PrefetchBlocks without Ack or Wait).
	Dropped      uint64 // not sent: no connection or free slot in time, too large, context done
	DroppedPaths uint64 // the paths of dropped Prefetch requests
	Sent         uint64 // handed to a connection
	Acked        uint64 // answered ok
	Refused      uint64 // answered with an error (ok: false)
	Lost         uint64 // the connection ended before the answer (the request is not resent)

	// The daemon's counts over the acknowledged fire-and-forget requests: files queued,
	// dropped on a full worker queue, and rejected before any I/O.
	FilesAccepted uint64
	FilesDropped  uint64
	FilesRejected uint64

	// Late counts replies that arrived after their caller stopped waiting (context done).
	Late uint64

	// Connections.
	Connects       uint64 // connections made, the first ones included
	Disconnects    uint64 // connections that ended (daemon restart, error, Close)
	DialFailures   uint64 // connection attempts that failed
	ProtocolErrors uint64 // connections closed because the daemon broke protocol v1
}

// counters are the live figures behind Counters.
type counters struct {
	sent, dropped, droppedPaths, acked, refused, lost   atomic.Uint64
	filesAccepted, filesDropped, filesRejected          atomic.Uint64
	late                                                atomic.Uint64
	connects, disconnects, dialFailures, protocolErrors atomic.Uint64
}

func (c *counters) snapshot() Counters {
	return Counters{
		Sent:           c.sent.Load(),
		Dropped:        c.dropped.Load(),
		DroppedPaths:   c.droppedPaths.Load(),
		Acked:          c.acked.Load(),
		Refused:        c.refused.Load(),
		Lost:           c.lost.Load(),
		FilesAccepted:  c.filesAccepted.Load(),
		FilesDropped:   c.filesDropped.Load(),
		FilesRejected:  c.filesRejected.Load(),
		Late:           c.late.Load(),
		Connects:       c.connects.Load(),
		Disconnects:    c.disconnects.Load(),
		DialFailures:   c.dialFailures.Load(),
		ProtocolErrors: c.protocolErrors.Load(),
	}
}

// drop records a fire-and-forget request that was never sent.
func (c *counters) drop(paths int) {
	c.dropped.Add(1)
	c.droppedPaths.Add(uint64(paths))
}

// ack records the daemon's answer to a fire-and-forget request.
func (c *counters) ack(r *reply) {
	if r.OK == nil || !*r.OK {
		c.refused.Add(1)
		return
	}
	c.acked.Add(1)
	c.filesAccepted.Add(nonNegative(r.Accepted))
	c.filesDropped.Add(nonNegative(r.Dropped))
	c.filesRejected.Add(nonNegative(r.Rejected))
}

func nonNegative(n *int) uint64 {
	if n == nil || *n < 0 {
		return 0
	}
	return uint64(*n)
}
