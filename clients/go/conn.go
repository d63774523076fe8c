package kvprefetch

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/vmihailenco/msgpack/v5"
)

const (
	// maxWriteBatch is how many queued frames one writev may carry: pipelined requests
	// from many goroutines leave in one system call.
	maxWriteBatch = 64
	// writeStall is how long the daemon may leave a frame untaken before the connection is
	// given up as wedged. The daemon stops reading a client only while its replies to that
	// client are unread, and this client always reads, so a stall means something is wrong.
	writeStall = 10 * time.Second
	// readBuffer is the reader's buffer; replies are small except stats and resolve.
	readBuffer = 64 << 10
	// keepPayload is the largest payload buffer the reader keeps between frames.
	keepPayload = 1 << 20
)

// Call states: the writer and the connection's end race for a queued call, and exactly
// one of them wins it.
const (
	callQueued  int32 = iota // registered, frame waiting for the writer
	callTaken                // the writer has it: the daemon may have seen the request
	callSettled              // the connection ended first: the frame was never written
)

// call is one request on one connection, from registration to its reply or to the end of
// the connection.
type call struct {
	id    uint64
	frame *bytes.Buffer
	// A fire-and-forget call has no waiter: its reply, or its loss, is only counted.
	fireAndForget bool
	paths         int
	done          chan result // buffered; nil for fire-and-forget
	state         atomic.Int32
	// abandoned is set when the caller stopped waiting (its context ended); the late
	// reply is then counted and dropped.
	abandoned atomic.Bool
}

type result struct {
	reply *reply
	err   error
}

// conn is one Unix-socket connection and its two goroutines: a writer that sends queued
// frames in batches, and a reader that hands each reply to its caller by request id. The
// protocol lets the daemon answer out of order (a Wait finishes after a later Ping), so
// any number of requests may be in flight, bounded by slots.
type conn struct {
	nc      net.Conn
	opts    *Options
	stats   *counters
	slots   chan struct{} // one token per request in flight (MaxInFlight)
	sendq   chan *call    // frames for the writer; holds at most one per slot
	done    chan struct{} // closed when the connection has ended
	ended   atomic.Bool   // set just before done is closed: alive() is on every call's path
	replies atomic.Uint64 // replies read, so the pool can tell a healthy connection

	mu      sync.Mutex
	pending map[uint64]*call // sent or queued, not yet answered
	err     error            // why the connection ended; set once
}

func newConn(nc net.Conn, opts *Options, stats *counters, wg *sync.WaitGroup) *conn {
	c := &conn{
		nc:      nc,
		opts:    opts,
		stats:   stats,
		slots:   make(chan struct{}, opts.MaxInFlight),
		sendq:   make(chan *call, opts.MaxInFlight),
		done:    make(chan struct{}),
		pending: make(map[uint64]*call),
	}
	wg.Add(2)
	go func() {
		defer wg.Done()
		c.fail(c.readLoop())
	}()
	go func() {
		defer wg.Done()
		c.writeLoop()
	}()
	return c
}

func (c *conn) alive() bool { return !c.ended.Load() }

func (c *conn) tryAcquire() bool {
	select {
	case c.slots <- struct{}{}:
		return true
	default:
		return false
	}
}

func (c *conn) release() { <-c.slots }

// send registers k and queues its frame; the caller holds a slot for it. It returns
// errNotSent once the connection has ended, so the caller can go to another.
func (c *conn) send(k *call) error {
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return errNotSent
	}
	c.pending[k.id] = k
	c.mu.Unlock()
	// Never blocks: every queued call holds a slot, and there are as many slots as room.
	c.sendq <- k
	return nil
}

// fail ends the connection (once) and settles every call still on it.
func (c *conn) fail(err error) {
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return
	}
	c.err = err
	pending := c.pending
	c.pending = nil
	c.mu.Unlock()
	c.ended.Store(true)
	close(c.done)
	c.nc.Close()
	for _, k := range pending {
		c.settle(k, err)
	}
}

// settle ends a call that its connection can no longer answer. A refused connection
// answers each call with the refusal, written or not: every connection of this peer would
// be refused alike. Otherwise a call the writer never took goes back to its caller as
// errNotSent (safe to send elsewhere); one it took may have been acted on, so it is lost.
// A fire-and-forget call is refused or lost: its caller is gone, and such requests are
// never resent.
func (c *conn) settle(k *call, err error) {
	written := !k.state.CompareAndSwap(callQueued, callSettled)
	c.release()
	var refusal *ServerError
	refused := errors.As(err, &refusal)
	switch {
	case k.fireAndForget && refused:
		c.stats.refused.Add(1)
		return
	case k.fireAndForget:
		c.stats.lost.Add(1)
		return
	case refused:
		err = &ServerError{Code: refusal.Code, Message: refusal.Message, RequestID: k.id}
	case !written:
		err = errNotSent
	case !errors.Is(err, ErrClosed):
		err = &lostError{cause: err}
	}
	k.done <- result{err: err}
}

func (c *conn) writeLoop() {
	batch := make([]*call, 0, maxWriteBatch)
	vecs := make([][]byte, 0, maxWriteBatch)
	for {
		select {
		case k := <-c.sendq:
			batch = append(batch, k)
		case <-c.done:
			return
		}
	more:
		for len(batch) < maxWriteBatch {
			select {
			case k := <-c.sendq:
				batch = append(batch, k)
			default:
				break more
			}
		}
		for _, k := range batch {
			if k.state.CompareAndSwap(callQueued, callTaken) {
				vecs = append(vecs, k.frame.Bytes())
			}
		}
		err := c.write(vecs)
		for i, k := range batch {
			if k.state.Load() == callTaken {
				recycleFrame(k.frame)
				k.frame = nil
			}
			batch[i] = nil
		}
		for i := range vecs {
			vecs[i] = nil
		}
		batch, vecs = batch[:0], vecs[:0]
		if err != nil {
			c.writeFailed(fmt.Errorf("writing to %s: %w", c.opts.SocketPath, err))
			return
		}
	}
}

// writeFailed ends the connection after a failed write. A daemon that closed it may have
// sent something first (a refusal), and the kernel hands that to the reader before it
// reports the close: so when the peer is gone, the reader ends the connection, with what
// it read.
func (c *conn) writeFailed(err error) {
	if errors.Is(err, syscall.EPIPE) || errors.Is(err, syscall.ECONNRESET) {
		select {
		case <-c.done:
			return
		case <-time.After(writeStall):
		}
	}
	c.fail(err)
}

func (c *conn) write(vecs [][]byte) error {
	if len(vecs) == 0 {
		return nil
	}
	if err := c.nc.SetWriteDeadline(time.Now().Add(writeStall)); err != nil {
		return err
	}
	if _, plain := c.nc.(*net.UnixConn); !plain && len(vecs) > 1 {
		// TLS: one record for the batch rather than one per frame.
		var joined bytes.Buffer
		for _, v := range vecs {
			joined.Write(v)
		}
		vecs = [][]byte{joined.Bytes()}
	}
	bufs := net.Buffers(vecs) // one writev for the whole batch
	_, err := bufs.WriteTo(c.nc)
	return err
}

// readLoop reads frames until the connection ends and returns why.
func (c *conn) readLoop() error {
	br := bufio.NewReaderSize(c.nc, readBuffer)
	src := bytes.NewReader(nil)
	dec := msgpack.NewDecoder(src)
	var header [headerSize]byte
	var kept []byte
	for {
		if _, err := io.ReadFull(br, header[:]); err != nil {
			return c.readError(err)
		}
		n := binary.BigEndian.Uint32(header[:])
		if uint64(n) > uint64(c.opts.MaxFrameBytes) {
			c.stats.protocolErrors.Add(1)
			return &ProtocolError{Reason: fmt.Sprintf("reply frame of %d bytes is above the %d-byte limit", n, c.opts.MaxFrameBytes)}
		}
		payload := kept
		if int(n) > cap(payload) {
			payload = make([]byte, n)
			if n <= keepPayload {
				kept = payload
			}
		}
		payload = payload[:n]
		if _, err := io.ReadFull(br, payload); err != nil {
			return c.readError(err)
		}
		r, err := decodeReply(dec, src, payload)
		if err == nil && r.refusal() {
			// The daemon refused this peer as it accepted it (`forbidden`, no id) and closes
			// the connection: the refusal answers every call on it, whenever it was sent.
			return &ServerError{Code: r.Error.Code, Message: r.Error.Message}
		}
		if err == nil {
			err = c.dispatch(r)
		}
		if err != nil {
			c.stats.protocolErrors.Add(1)
			return err
		}
	}
}

func (c *conn) readError(err error) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("kvprefetchd at %s closed the connection", c.opts.SocketPath)
	}
	return fmt.Errorf("reading from %s: %w", c.opts.SocketPath, err)
}

// dispatch hands a reply to the call it answers.
func (c *conn) dispatch(r *reply) error {
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return nil // ended meanwhile; its calls are settled already
	}
	var k *call
	if r.ID != nil {
		k = c.pending[*r.ID]
	} else if r.OK != nil && !*r.OK {
		// An error for a request whose id the daemon could not read (too_large, an
		// undecodable frame): blame the oldest request in flight, as the Python client
		// does. The client refuses oversize frames itself, so this means a bug somewhere.
		k = c.oldestLocked()
	}
	if k == nil {
		c.mu.Unlock()
		id := "nil"
		if r.ID != nil {
			id = fmt.Sprint(*r.ID)
		}
		return &ProtocolError{Reason: "reply for unknown request id " + id}
	}
	delete(c.pending, k.id)
	c.mu.Unlock()
	c.replies.Add(1)
	c.release()
	switch {
	case k.fireAndForget:
		c.stats.ack(r)
	case k.abandoned.Load():
		c.stats.late.Add(1)
	default:
		k.done <- result{reply: r}
	}
	return nil
}

// refusal is the daemon's refusal of this peer if that is what ended the connection.
func (c *conn) refusal() *ServerError {
	c.mu.Lock()
	defer c.mu.Unlock()
	var refusal *ServerError
	if errors.As(c.err, &refusal) {
		return refusal
	}
	return nil
}

func (c *conn) oldestLocked() *call {
	var oldest *call
	for _, k := range c.pending {
		if oldest == nil || k.id < oldest.id {
			oldest = k
		}
	}
	return oldest
}
