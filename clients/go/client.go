package kvprefetch

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
)

// Client talks to one kvprefetchd over a small pool of Unix-socket connections. It is
// safe for concurrent use; make one per process and share it.
type Client struct {
	opts   Options
	ids    atomic.Uint64 // request ids, unique over the client's connections
	stats  counters
	pool   *pool
	cancel context.CancelFunc
	wg     sync.WaitGroup
	closed sync.Once
}

// New returns a client and starts connecting in the background: it does not wait for the
// daemon, which may well start after the router. Only invalid options are an error.
func New(opts Options) (*Client, error) {
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	c := &Client{opts: opts, cancel: cancel}
	c.pool = newPool(ctx, &c.opts, &c.stats, &c.wg)
	c.pool.start()
	return c, nil
}

// Close ends every connection and waits for the client's goroutines. Calls waiting for a
// reply return ErrClosed; fire-and-forget requests still unanswered are counted Lost.
func (c *Client) Close() error {
	c.closed.Do(func() {
		c.cancel()
		c.pool.closeAll()
		c.wg.Wait()
	})
	return nil
}

// SocketPath is the socket the client connects to.
func (c *Client) SocketPath() string { return c.opts.SocketPath }

// Counters returns a snapshot of the client's own counts (named so as not to clash with
// Stats, the daemon's).
func (c *Client) Counters() Counters { return c.stats.snapshot() }

// Ping asks the daemon who it is. It waits for a connection until ctx ends (or
// Options.CallTimeout without a deadline), so it also serves to wait for the daemon; a
// daemon that refuses this peer answers at once (a *ServerError, CodeForbidden).
func (c *Client) Ping(ctx context.Context) (PingResult, error) {
	ctx, cancel := c.bound(ctx, 0)
	defer cancel()
	r, err := c.roundTrip(ctx, func(id uint64) (*bytes.Buffer, error) {
		return encodeValue(&plainRequest{V: ProtocolVersion, ID: id, Op: opPing}, c.opts.MaxFrameBytes)
	})
	if err != nil {
		return PingResult{}, err
	}
	return r.ping()
}

// Stats returns the daemon's counters and gauges (requests, files by outcome, queue
// depths, per-worker figures, ...), as plain Go values.
func (c *Client) Stats(ctx context.Context) (map[string]any, error) {
	ctx, cancel := c.bound(ctx, 0)
	defer cancel()
	r, err := c.roundTrip(ctx, func(id uint64) (*bytes.Buffer, error) {
		return encodeValue(&plainRequest{V: ProtocolVersion, ID: id, Op: opStats}, c.opts.MaxFrameBytes)
	})
	if err != nil {
		return nil, err
	}
	return r.stats()
}

// Doctor returns what the daemon knows about warming each of its roots (docs/protocol.md,
// "The `doctor` reply"): "host", "roots" (per root its file system, tier profile, FUSE
// limits and "problems", each with its "fix", and "useful") and "useful", as plain Go
// values. The daemon touches no file system to answer; `kvprefetch doctor` adds a live probe.
func (c *Client) Doctor(ctx context.Context) (map[string]any, error) {
	ctx, cancel := c.bound(ctx, 0)
	defer cancel()
	r, err := c.roundTrip(ctx, func(id uint64) (*bytes.Buffer, error) {
		return encodeValue(&plainRequest{V: ProtocolVersion, ID: id, Op: opDoctor}, c.opts.MaxFrameBytes)
	})
	if err != nil {
		return nil, err
	}
	return r.doctor()
}

// Prefetch asks the daemon to warm the heads of paths (absolute, under its roots).
//
// By default it is fire-and-forget: it returns as soon as the request is handed to a
// connection, having waited at most Options.FireAndForgetTimeout (or less, if ctx ends
// sooner) for a connection and a free slot; otherwise the request is dropped, counted, and
// a *DroppedError returned, which a router may ignore. The request outlives ctx: cancelling
// the router's request after Prefetch returns does not recall the warm-up. The result is
// then zero; the daemon's answer shows in Counters. An empty paths sends nothing.
//
// With opts.Ack or opts.Wait it waits for the daemon's answer until ctx ends.
func (c *Client) Prefetch(ctx context.Context, paths []string, opts PrefetchOptions) (PrefetchResult, error) {
	if err := opts.check(); err != nil {
		return PrefetchResult{}, err
	}
	if opts.fireAndForget() {
		if len(paths) == 0 {
			return PrefetchResult{}, nil
		}
		deadline := deadlineOf(opts, ctx)
		return PrefetchResult{}, c.fire(ctx, len(paths), func(id uint64) (*bytes.Buffer, error) {
			return encodePrefetch(id, paths, opts, nil, deadline, c.opts.MaxFrameBytes)
		})
	}
	deadline := deadlineOf(opts, ctx) // the caller's deadline, not the call's bound
	ctx, cancel := c.bound(ctx, waitAllowance(opts))
	defer cancel()
	timeoutMS := opts.timeoutMS(ctx)
	r, err := c.roundTrip(ctx, func(id uint64) (*bytes.Buffer, error) {
		return encodePrefetch(id, paths, opts, timeoutMS, deadline, c.opts.MaxFrameBytes)
	})
	if err != nil {
		return PrefetchResult{}, err
	}
	return r.prefetch()
}

// PrefetchBlocks asks the daemon to warm the files a KV request maps to: it hashes the
// prompts' tokens as vLLM does and lays out the paths as the fs connector does. It is
// fire-and-forget by default, exactly as Prefetch (drops are counted in Dropped, not
// DroppedPaths, since the paths are only known to the daemon).
func (c *Client) PrefetchBlocks(ctx context.Context, req BlocksRequest) (PrefetchResult, error) {
	opts := req.PrefetchOptions
	if err := opts.check(); err != nil {
		return PrefetchResult{}, err
	}
	deadlineMS, deadlineUnixMS := opts.deadline(ctx) // the caller's, not the call's bound
	build := func(ctx context.Context) func(uint64) (*bytes.Buffer, error) {
		wire := kvRequest{
			V: ProtocolVersion, Op: opPrefetchBlocks, KVRequest: req.KVRequest,
			Wait: opts.Wait, ReadBytes: opts.ReadBytes, TimeoutMS: opts.timeoutMS(ctx),
			DeadlineMS: deadlineMS, DeadlineUnixMS: deadlineUnixMS, MaxFailures: opts.MaxFailures,
		}
		return func(id uint64) (*bytes.Buffer, error) {
			wire.ID = id
			return encodeValue(&wire, c.opts.MaxFrameBytes)
		}
	}
	if opts.fireAndForget() {
		return PrefetchResult{}, c.fire(ctx, 0, build(ctx))
	}
	ctx, cancel := c.bound(ctx, waitAllowance(opts))
	defer cancel()
	r, err := c.roundTrip(ctx, build(ctx))
	if err != nil {
		return PrefetchResult{}, err
	}
	return r.prefetch()
}

// Check reports the residency of paths by their roots' rules (page cache, or a tier's
// st_blocks), reading nothing and changing no atime, like vmtouch without -t.
func (c *Client) Check(ctx context.Context, paths []string, opts CheckOptions) (CheckResult, error) {
	if opts.Whole {
		return CheckResult{}, errors.New("kvprefetch: Whole applies only to Evict")
	}
	return c.inspect(ctx, opCheck, paths, opts)
}

// Evict drops the heads of paths (opts.Whole: the whole files) from the page cache, for
// benchmarks and operators. The daemon refuses (a *ServerError, CodeForbidden) unless it
// runs with allow_evict = true: it takes cache from every user of the host.
func (c *Client) Evict(ctx context.Context, paths []string, opts CheckOptions) (CheckResult, error) {
	return c.inspect(ctx, opEvict, paths, opts)
}

func (c *Client) inspect(ctx context.Context, op string, paths []string, opts CheckOptions) (CheckResult, error) {
	if opts.ReadBytes < 0 || opts.Timeout < 0 {
		return CheckResult{}, errors.New("kvprefetch: ReadBytes and Timeout must not be negative")
	}
	ctx, cancel := c.bound(ctx, opts.Timeout)
	defer cancel()
	wire := inspectRequest{V: ProtocolVersion, Op: op, Paths: paths, ReadBytes: opts.ReadBytes,
		Details: opts.Details, Whole: opts.Whole}
	if opts.Timeout > 0 {
		ms := opts.Timeout.Milliseconds()
		wire.TimeoutMS = &ms
	}
	r, err := c.roundTrip(ctx, func(id uint64) (*bytes.Buffer, error) {
		wire.ID = id
		return encodeValue(&wire, c.opts.MaxFrameBytes)
	})
	if err != nil {
		return CheckResult{}, err
	}
	return r.checkResult()
}

// Resolve returns the block hashes and file paths a KV request maps to, without any I/O:
// to check a profile, or to warm the paths some other way.
func (c *Client) Resolve(ctx context.Context, req KVRequest) (Resolution, error) {
	ctx, cancel := c.bound(ctx, 0)
	defer cancel()
	r, err := c.roundTrip(ctx, func(id uint64) (*bytes.Buffer, error) {
		return encodeValue(&kvRequest{V: ProtocolVersion, ID: id, Op: opResolve, KVRequest: req}, c.opts.MaxFrameBytes)
	})
	if err != nil {
		return Resolution{}, err
	}
	return r.resolution()
}

// waitAllowance is how much longer than CallTimeout a call may take: a Wait is answered
// only after its Timeout at worst.
func waitAllowance(o PrefetchOptions) time.Duration {
	if o.Wait {
		return o.Timeout
	}
	return 0
}

// bound gives ctx a deadline when it has none, so that no call can hang on a daemon that
// never answers.
func (c *Client) bound(ctx context.Context, extra time.Duration) (context.Context, context.CancelFunc) {
	if _, ok := ctx.Deadline(); ok {
		return ctx, func() {}
	}
	return context.WithTimeout(ctx, c.opts.CallTimeout+extra)
}

// roundTrip sends one request and waits for its reply until ctx ends. A request its
// connection lost before writing it is sent again on another; once written, it never is.
func (c *Client) roundTrip(ctx context.Context, build func(id uint64) (*bytes.Buffer, error)) (*reply, error) {
	id := c.ids.Add(1)
	frame, err := build(id)
	if err != nil {
		return nil, err
	}
	for {
		cn, err := c.pool.acquire(ctx)
		if err != nil {
			recycleFrame(frame)
			return nil, err
		}
		k := &call{id: id, frame: frame, done: make(chan result, 1)}
		if cn.send(k) != nil {
			cn.release()
			continue
		}
		select {
		case res := <-k.done:
			if res.err == errNotSent {
				continue // the frame is ours again
			}
			if res.err != nil {
				return nil, res.err
			}
			return res.reply, res.reply.check()
		case <-ctx.Done():
			k.abandoned.Store(true)
			return nil, fmt.Errorf("kvprefetch: no reply from %s: %w", c.opts.SocketPath, ctx.Err())
		}
	}
}

// fireAttempts bounds how often a fire-and-forget request looks for another connection
// when the one it got ends under it.
const fireAttempts = 3

// fire sends a request nobody waits for. Its reply is read and counted by the connection.
func (c *Client) fire(ctx context.Context, paths int, build func(id uint64) (*bytes.Buffer, error)) error {
	drop := func(cause error) error {
		c.stats.drop(paths)
		return &DroppedError{Cause: cause}
	}
	if err := ctx.Err(); err != nil {
		return drop(err)
	}
	id := c.ids.Add(1)
	frame, err := build(id)
	if err != nil {
		return drop(err)
	}
	k := &call{id: id, frame: frame, fireAndForget: true, paths: paths}
	var wait context.Context
	for attempt := 0; attempt < fireAttempts; attempt++ {
		cn := c.pool.tryAcquire()
		if cn == nil {
			// The slow path: a timer only when no slot is free at once.
			if wait == nil {
				var cancel context.CancelFunc
				wait, cancel = context.WithTimeout(ctx, c.opts.FireAndForgetTimeout)
				defer cancel()
			}
			if cn, err = c.pool.acquire(wait); err != nil {
				recycleFrame(frame)
				return drop(err)
			}
		}
		if cn.send(k) == nil {
			c.stats.sent.Add(1)
			return nil
		}
		cn.release()
	}
	recycleFrame(frame)
	return drop(ErrUnavailable)
}
