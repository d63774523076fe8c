// Package kvprefetch is the Go client of kvprefetchd, the daemon that warms KV-cache files
// before the GPU needs them. It speaks wire protocol v1 (docs/protocol.md in the
// kvprefetchd repository) and nothing else: no daemon code is shared.
//
// A router's PreRequest hook builds the request, sends it, and never waits:
//
//	kv, err := kvprefetch.New(kvprefetch.Options{SocketPath: "/run/kvprefetchd/kvprefetchd.sock"})
//	...
//	_, err = kv.Prefetch(ctx, paths, kvprefetch.PrefetchOptions{})
//	// err is nil once the request is on its way, or a *DroppedError after at most
//	// Options.FireAndForgetTimeout (1 ms by default); either way the request path goes on.
//
// Fire-and-forget requests still carry ids, and their replies are read and counted:
// Counters shows how many were acknowledged, refused, dropped by the client or lost with a
// connection, and the daemon's own accepted/dropped/rejected file counts.
//
// How it works: a pool of Options.PoolSize connections, each with a writer goroutine that
// batches queued frames into one writev and a reader goroutine that matches replies to
// callers by request id, so any number of requests are pipelined and may be answered out
// of order. Each connection has Options.MaxInFlight slots; a fire-and-forget request that
// finds none free within its deadline is dropped rather than queued, which bounds memory
// when the daemon falls behind. When the daemon goes away (a restart), every connection
// redials in the background with jittered exponential backoff; requests not yet written
// are sent on another connection, and calls that wait simply wait for one to come up.
//
// Calls that wait for a reply (Ping, Stats, Resolve, and Prefetch or PrefetchBlocks with
// Ack or Wait) are bounded by their context, or by Options.CallTimeout when it has no
// deadline.
package kvprefetch
