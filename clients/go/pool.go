package kvprefetch

import (
	"context"
	"crypto/tls"
	"fmt"
	"math/rand"
	"net"
	"sync"
	"sync/atomic"
	"time"
)

// pool keeps PoolSize connections up. Each slot has a goroutine that dials, waits for its
// connection to end, and dials again with backoff, so a daemon restart costs the router a
// few dropped warm-ups rather than errors on every call, and callers never dial themselves.
type pool struct {
	opts  *Options
	stats *counters
	ctx   context.Context // done once the client is closed
	wg    *sync.WaitGroup
	conns []atomic.Pointer[conn]
	next  atomic.Uint64 // round robin over conns

	mu      sync.Mutex
	ready   chan struct{} // closed, and replaced, whenever a connection comes up or is refused
	lastErr error         // the last failed dial, for ErrUnavailable's message
	refusal *ServerError  // the daemon refused the last connection that ended
}

func newPool(ctx context.Context, opts *Options, stats *counters, wg *sync.WaitGroup) *pool {
	return &pool{
		opts:  opts,
		stats: stats,
		ctx:   ctx,
		wg:    wg,
		conns: make([]atomic.Pointer[conn], opts.PoolSize),
		ready: make(chan struct{}),
	}
}

func (p *pool) start() {
	for i := range p.conns {
		p.wg.Add(1)
		go func(i int) {
			defer p.wg.Done()
			p.keep(i)
		}(i)
	}
}

// closeAll ends every connection; called once the context is cancelled.
func (p *pool) closeAll() {
	for i := range p.conns {
		if c := p.conns[i].Load(); c != nil {
			c.fail(ErrClosed)
		}
	}
}

// keep holds slot i connected until the client closes.
func (p *pool) keep(i int) {
	rng := rand.New(rand.NewSource(time.Now().UnixNano() + int64(i)))
	delay := p.opts.ReconnectMin
	backoff := func() bool {
		// Full delay plus up to as much again: routers restarted together spread out.
		wait := delay + time.Duration(rng.Int63n(int64(delay)+1))
		if delay *= 2; delay > p.opts.ReconnectMax {
			delay = p.opts.ReconnectMax
		}
		t := time.NewTimer(wait)
		defer t.Stop()
		select {
		case <-t.C:
			return true
		case <-p.ctx.Done():
			return false
		}
	}
	for p.ctx.Err() == nil {
		c, err := p.dial()
		if err != nil {
			p.stats.dialFailures.Add(1)
			p.setLastErr(err)
			if !backoff() {
				return
			}
			continue
		}
		p.stats.connects.Add(1)
		born := time.Now()
		p.conns[i].Store(c)
		p.announce()
		if p.ctx.Err() != nil {
			c.fail(ErrClosed) // Close ran before the Store and could not see c
		}
		<-c.done
		p.conns[i].CompareAndSwap(c, nil)
		p.stats.disconnects.Add(1)
		p.setRefusal(c.refusal())
		if c.replies.Load() > 0 || time.Since(born) >= p.opts.ReconnectMax {
			// A connection that worked: the daemon restarted or dropped us. Come back fast.
			delay = p.opts.ReconnectMin
			continue
		}
		// Accepted and closed at once (too many connections, a forbidden peer): do not spin.
		if !backoff() {
			return
		}
	}
}

func (p *pool) dial() (*conn, error) {
	d := net.Dialer{Timeout: p.opts.DialTimeout}
	ep := p.opts.endpoint
	var nc net.Conn
	var err error
	switch ep.kind {
	case "tls":
		cfg := p.opts.TLSConfig.Clone()
		if cfg.ServerName == "" {
			cfg.ServerName = ep.host
		}
		td := tls.Dialer{NetDialer: &d, Config: cfg}
		nc, err = td.DialContext(p.ctx, "tcp", ep.address)
	case "tcp":
		nc, err = d.DialContext(p.ctx, "tcp", ep.address)
	default:
		nc, err = d.DialContext(p.ctx, "unix", ep.address)
	}
	if err != nil {
		return nil, err
	}
	return newConn(nc, p.opts, p.stats, p.wg), nil
}

func (p *pool) announce() {
	p.mu.Lock()
	close(p.ready)
	p.ready = make(chan struct{})
	p.mu.Unlock()
}

func (p *pool) readyChan() <-chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.ready
}

func (p *pool) setLastErr(err error) {
	p.mu.Lock()
	p.lastErr = err
	p.mu.Unlock()
}

// setRefusal records whether the daemon refused the connection that just ended, and wakes
// the callers waiting for a connection so that they see it.
func (p *pool) setRefusal(refusal *ServerError) {
	p.mu.Lock()
	p.refusal = refusal
	p.mu.Unlock()
	if refusal != nil {
		p.announce()
	}
}

// refused is the daemon's refusal of this peer, if the last connection to end was refused.
// Waiting for another connection would be waiting to be refused again, so a caller that
// finds none up gets the refusal at once (its RequestID is 0: no connection took it).
func (p *pool) refused() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.refusal == nil {
		return nil
	}
	refusal := *p.refusal
	return &refusal
}

func (p *pool) unavailable(cause error) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return &unavailableError{cause: cause, lastErr: p.lastErr}
}

// pick returns a live connection, the next in turn first, or nil when none is up.
func (p *pool) pick() *conn {
	n := uint64(len(p.conns))
	start := p.next.Add(1)
	for i := uint64(0); i < n; i++ {
		if c := p.conns[(start+i)%n].Load(); c != nil && c.alive() {
			return c
		}
	}
	return nil
}

// tryAcquire returns a live connection with a slot taken, without waiting, or nil.
func (p *pool) tryAcquire() *conn {
	n := uint64(len(p.conns))
	start := p.next.Add(1)
	for i := uint64(0); i < n; i++ {
		if c := p.conns[(start+i)%n].Load(); c != nil && c.alive() && c.tryAcquire() {
			return c
		}
	}
	return nil
}

// acquire returns a live connection with a slot taken, waiting until ctx ends for a
// connection to come up or a slot to free.
func (p *pool) acquire(ctx context.Context) (*conn, error) {
	for {
		if p.ctx.Err() != nil {
			return nil, ErrClosed
		}
		if c := p.tryAcquire(); c != nil {
			return c, nil
		}
		ready := p.readyChan() // before pick, so an announcement in between is not missed
		c := p.pick()
		if c == nil {
			if err := p.refused(); err != nil {
				return nil, err
			}
			select {
			case <-ready:
				continue
			case <-ctx.Done():
				return nil, p.unavailable(ctx.Err())
			case <-p.ctx.Done():
				return nil, ErrClosed
			}
		}
		select {
		case c.slots <- struct{}{}:
			if c.alive() {
				return c, nil
			}
			c.release()
		case <-c.done:
		case <-ready:
		case <-ctx.Done():
			return nil, fmt.Errorf("kvprefetch: every connection has %d requests in flight: %w",
				p.opts.MaxInFlight, ctx.Err())
		case <-p.ctx.Done():
			return nil, ErrClosed
		}
	}
}
