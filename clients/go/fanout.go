package kvprefetch

import (
	"context"
	"time"
)

// Fanout sends one warm-up to several daemons at once: typically the gateway's (whose
// read promotes the files on the shared tier) and the scheduled GPU node's (whose read
// brings them into the page cache the inference engine reads from). Each Target is a
// Client of its own, with its own connections and Counters, and its own options (the
// node's daemon may warm by advice where the gateway must read).
//
// Fire-and-forget only, and never waits: each target's request is handed to its
// client on a goroutine of its own, so the caller's cost is a few goroutine starts
// whatever the daemons do; a target that cannot take the request within its
// FireAndForgetTimeout drops it and counts it in its Counters. Deadlines ride along as
// in Prefetch: the context's deadline (or Options.Deadline) is taken now, before the call
// returns, so the caller may cancel ctx at once.
type Fanout struct {
	Targets []FanoutTarget
}

// FanoutTarget is one daemon of a Fanout and how it is asked.
type FanoutTarget struct {
	Client  *Client
	Options PrefetchOptions // Ack and Wait are ignored: fan-out is fire-and-forget
}

// Prefetch sends paths to every target and returns at once.
func (f Fanout) Prefetch(ctx context.Context, paths []string) {
	if len(paths) == 0 {
		return
	}
	detached := detach(ctx)
	for _, t := range f.Targets {
		go func(c *Client, opts PrefetchOptions) {
			_, _ = c.Prefetch(detached, paths, opts) // a drop is counted in c.Counters
		}(t.Client, t.options(ctx))
	}
}

// PrefetchBlocks sends a KV request to every target and returns at once.
func (f Fanout) PrefetchBlocks(ctx context.Context, req KVRequest) {
	detached := detach(ctx)
	for _, t := range f.Targets {
		go func(c *Client, r BlocksRequest) {
			_, _ = c.PrefetchBlocks(detached, r)
		}(t.Client, BlocksRequest{KVRequest: req, PrefetchOptions: t.options(ctx)})
	}
}

// options are the target's, fire-and-forget, with the caller's deadline taken now.
func (t FanoutTarget) options(ctx context.Context) PrefetchOptions {
	opts := t.Options
	opts.Ack, opts.Wait = false, false
	if opts.Deadline.IsZero() && !opts.NoDeadline {
		if d, ok := ctx.Deadline(); ok {
			opts.Deadline = d
		}
	}
	return opts
}

// detach keeps ctx's values and drops its cancellation and deadline: the send must not
// be recalled when the caller's request ends right after the fan-out (its deadline is
// already copied into the options).
func detach(ctx context.Context) context.Context {
	return valuesOnly{ctx}
}

type valuesOnly struct{ parent context.Context }

func (v valuesOnly) Deadline() (deadline time.Time, ok bool) { return time.Time{}, false }
func (v valuesOnly) Done() <-chan struct{}                   { return nil }
func (v valuesOnly) Err() error                              { return nil }
func (v valuesOnly) Value(key any) any                       { return v.parent.Value(key) }
