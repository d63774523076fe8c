package kvprefetch

// A scripted stand-in for the daemon, for what the real one will not do on demand: answer
// out of order, stay silent, send an id-less error, an unknown id or a runaway frame. The
// real daemon is tested in daemon_test.go.

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/kvprefetchd/kvprefetchd/clients/go/internal/testwait"
	"github.com/vmihailenco/msgpack/v5"
)

// fake serves each accepted connection with its handler, in turn: connection i gets
// handlers[min(i, last)].
type fake struct {
	socket string
	ln     net.Listener
	wg     sync.WaitGroup
}

type fakeConn struct {
	t  *testing.T
	nc net.Conn
}

func startFake(t *testing.T, handlers ...func(*fakeConn)) *fake {
	t.Helper()
	dir, err := os.MkdirTemp("", "kvp-fake-")
	if err != nil {
		t.Fatal(err)
	}
	f := &fake{socket: filepath.Join(dir, "f.sock")}
	if f.ln, err = net.Listen("unix", f.socket); err != nil {
		t.Fatal(err)
	}
	f.wg.Add(1)
	go func() {
		defer f.wg.Done()
		for i := 0; ; i++ {
			nc, err := f.ln.Accept()
			if err != nil {
				return
			}
			h := handlers[len(handlers)-1]
			if i < len(handlers) {
				h = handlers[i]
			}
			f.wg.Add(1)
			go func() {
				defer f.wg.Done()
				defer nc.Close()
				h(&fakeConn{t: t, nc: nc})
			}()
		}
	}()
	t.Cleanup(func() {
		f.ln.Close()
		f.wg.Wait()
		os.RemoveAll(dir)
	})
	return f
}

// read returns the next request, or nil when the client has gone.
func (fc *fakeConn) read() map[string]any {
	var header [4]byte
	if _, err := io.ReadFull(fc.nc, header[:]); err != nil {
		return nil
	}
	body := make([]byte, binary.BigEndian.Uint32(header[:]))
	if _, err := io.ReadFull(fc.nc, body); err != nil {
		return nil
	}
	var m map[string]any
	if err := msgpack.Unmarshal(body, &m); err != nil {
		fc.t.Errorf("fake daemon: undecodable request: %v", err)
		return nil
	}
	return m
}

func (fc *fakeConn) write(m map[string]any) {
	body, err := msgpack.Marshal(m)
	if err != nil {
		fc.t.Errorf("fake daemon: %v", err)
		return
	}
	fc.writeRaw(binary.BigEndian.AppendUint32(nil, uint32(len(body))), body)
}

func (fc *fakeConn) writeRaw(parts ...[]byte) {
	for _, p := range parts {
		if _, err := fc.nc.Write(p); err != nil {
			return // the client went; its side of the test will say so
		}
	}
}

// answer is the daemon's reply to req: an ack counting its paths, or a ping.
func answer(req map[string]any) map[string]any {
	r := map[string]any{"id": req["id"], "ok": true}
	switch req["op"] {
	case "ping":
		r["version"], r["protocol"], r["engine"], r["workers"] = "fake", 1, "pread", 1
	case "prefetch":
		r["accepted"], r["dropped"], r["rejected"] = len(req["paths"].([]any)), 0, 0
	}
	return r
}

// serve answers every request in order.
func serve(fc *fakeConn) {
	for req := fc.read(); req != nil; req = fc.read() {
		fc.write(answer(req))
	}
}

// afterOne reads one request and hands it to then; nothing if the client went first.
func afterOne(then func(fc *fakeConn, req map[string]any)) func(*fakeConn) {
	return func(fc *fakeConn) {
		if req := fc.read(); req != nil {
			then(fc, req)
		}
	}
}

// silent reads every request and answers none.
func silent(fc *fakeConn) {
	for fc.read() != nil {
	}
}

func fakeClient(t *testing.T, f *fake, opts Options) *Client {
	t.Helper()
	opts.SocketPath = f.socket
	c, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func paths(n int) []string {
	p := make([]string, n)
	for i := range p {
		p[i] = "/kv/x"
	}
	return p
}

func TestOutOfOrderRepliesReachTheirCallers(t *testing.T) {
	f := startFake(t, func(fc *fakeConn) {
		first, second := fc.read(), fc.read()
		if first == nil || second == nil {
			return
		}
		fc.write(answer(second)) // the later request is answered first
		fc.write(answer(first))
		serve(fc)
	})
	c := fakeClient(t, f, Options{PoolSize: 1})
	ctx := testwait.Within(t, 30*time.Second)
	var wg sync.WaitGroup
	got := make([]int, 2)
	errs := make([]error, 2)
	for i := range got {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			res, err := c.Prefetch(ctx, paths(i+1), PrefetchOptions{Ack: true})
			got[i], errs[i] = res.Accepted, err
		}(i)
	}
	wg.Wait()
	for i := range got {
		if errs[i] != nil || got[i] != i+1 {
			t.Fatalf("caller %d got %d accepted (%v), want %d", i, got[i], errs[i], i+1)
		}
	}
}

func TestIdlessErrorIsBlamedOnTheOldestRequest(t *testing.T) {
	f := startFake(t, afterOne(func(fc *fakeConn, _ map[string]any) {
		fc.write(map[string]any{"id": nil, "ok": false, "error": map[string]any{"code": "too_large", "message": "frame of 99 bytes"}})
		serve(fc)
	}))
	c := fakeClient(t, f, Options{PoolSize: 1})
	_, err := c.Ping(testwait.Within(t, 30*time.Second))
	var se *ServerError
	if !errors.As(err, &se) || se.Code != CodeTooLarge {
		t.Fatalf("want the too_large error, got %v", err)
	}
	if _, err := c.Ping(testwait.Within(t, 30*time.Second)); err != nil {
		t.Fatalf("the connection must go on: %v", err)
	}
}

// A daemon refuses a peer it does not allow as it accepts the connection: one `forbidden`
// reply without an id, then it closes. Whether the refusal is read before or after a call
// takes the connection, the call gets the refusal: never a protocol error, never a wait for
// a connection that would be refused in turn.
func TestARefusalAnswersTheCalls(t *testing.T) {
	f := startFake(t, func(fc *fakeConn) {
		fc.write(map[string]any{"id": nil, "ok": false, "error": map[string]any{"code": "forbidden", "message": "this user may not"}})
	})
	c := fakeClient(t, f, Options{PoolSize: 1})
	for i := 0; i < 3; i++ {
		_, err := c.Ping(testwait.Within(t, 10*time.Second))
		var se *ServerError
		if !errors.As(err, &se) || se.Code != CodeForbidden {
			t.Fatalf("call %d: want the forbidden refusal, got %v", i, err)
		}
	}
	if _, err := c.Prefetch(context.Background(), paths(1), PrefetchOptions{}); err != nil {
		var se *ServerError
		if !errors.Is(err, ErrDropped) || !errors.As(err, &se) || se.Code != CodeForbidden {
			t.Fatalf("fire-and-forget: want a drop for the refusal, got %v", err)
		}
	} else {
		testwait.Eventually(t, "the refusal to be counted", func() bool { return c.Counters().Refused == 1 })
	}
	if got := c.Counters(); got.ProtocolErrors != 0 || got.Lost != 0 {
		t.Fatalf("counters: %+v", got)
	}
}

func TestUnknownIDEndsTheConnectionAndTheClientReconnects(t *testing.T) {
	f := startFake(t, afterOne(func(fc *fakeConn, _ map[string]any) {
		fc.write(map[string]any{"id": 999999, "ok": true})
		silent(fc)
	}), serve)
	c := fakeClient(t, f, Options{PoolSize: 1})
	_, err := c.Ping(testwait.Within(t, 30*time.Second))
	var pe *ProtocolError
	if !errors.Is(err, ErrConnectionLost) || !errors.As(err, &pe) {
		t.Fatalf("want a lost connection caused by a protocol error, got %v", err)
	}
	if _, err := c.Ping(testwait.Within(t, 30*time.Second)); err != nil {
		t.Fatalf("after reconnecting: %v", err)
	}
	if got := c.Counters(); got.ProtocolErrors != 1 || got.Connects != 2 {
		t.Fatalf("counters: %+v", got)
	}
}

func TestRunawayReplyFrameIsAProtocolError(t *testing.T) {
	f := startFake(t, afterOne(func(fc *fakeConn, _ map[string]any) {
		fc.writeRaw([]byte{0xff, 0xff, 0xff, 0xff})
		silent(fc)
	}), serve)
	c := fakeClient(t, f, Options{PoolSize: 1})
	_, err := c.Ping(testwait.Within(t, 30*time.Second))
	var pe *ProtocolError
	if !errors.As(err, &pe) {
		t.Fatalf("want a protocol error, got %v", err)
	}
}

func TestLateRepliesAreCountedNotMisdelivered(t *testing.T) {
	release := make(chan struct{})
	f := startFake(t, afterOne(func(fc *fakeConn, first map[string]any) {
		<-release
		fc.write(answer(first))
		serve(fc)
	}))
	c := fakeClient(t, f, Options{PoolSize: 1})
	_, err := c.Ping(testwait.Within(t, 20*time.Millisecond))
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("want the deadline, got %v", err)
	}
	close(release)
	res, err := c.Prefetch(testwait.Within(t, 30*time.Second), paths(3), PrefetchOptions{Ack: true})
	if err != nil || res.Accepted != 3 {
		t.Fatalf("the next call must get its own reply: %+v, %v", res, err)
	}
	if got := c.Counters().Late; got != 1 {
		t.Fatalf("late replies: %d", got)
	}
}

// A daemon that stops answering fills the slots; fire-and-forget then drops within its
// deadline instead of queueing without bound or blocking the caller.
func TestFireAndForgetDropsWhenEverySlotIsTaken(t *testing.T) {
	f := startFake(t, silent)
	c := fakeClient(t, f, Options{PoolSize: 1, MaxInFlight: 2})
	testwait.Eventually(t, "a connection", func() bool { return c.Counters().Connects == 1 })
	if _, err := c.Ping(testwait.Within(t, 50*time.Millisecond)); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("silent daemon: %v", err) // connected, and one slot now held by the ping
	}
	if _, err := c.Prefetch(context.Background(), paths(1), PrefetchOptions{}); err != nil {
		t.Fatalf("the last free slot: %v", err)
	}
	_, err := c.Prefetch(context.Background(), paths(5), PrefetchOptions{})
	if !errors.Is(err, ErrDropped) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("want a drop for want of a slot, got %v", err)
	}
	if got := c.Counters(); got.Sent != 1 || got.Dropped != 1 || got.DroppedPaths != 5 {
		t.Fatalf("counters: %+v", got)
	}
	// A cancelled context drops at once too.
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := c.Prefetch(ctx, paths(1), PrefetchOptions{}); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled context: %v", err)
	}
}

// A request the daemon may have seen is never sent twice: the caller learns its fate is
// unknown, and the next call goes out on a new connection.
func TestWrittenRequestLostWithItsConnectionIsNotResent(t *testing.T) {
	var pings atomic.Int32
	count := func(fc *fakeConn) {
		for req := fc.read(); req != nil; req = fc.read() {
			if req["op"] == "ping" {
				pings.Add(1)
			}
			fc.write(answer(req))
		}
	}
	f := startFake(t, func(fc *fakeConn) {
		if fc.read() != nil {
			pings.Add(1) // then hang up without answering
		}
	}, count)
	c := fakeClient(t, f, Options{PoolSize: 1})
	if _, err := c.Ping(testwait.Within(t, 30*time.Second)); !errors.Is(err, ErrConnectionLost) {
		t.Fatalf("want ErrConnectionLost, got %v", err)
	}
	if _, err := c.Ping(testwait.Within(t, 30*time.Second)); err != nil {
		t.Fatal(err)
	}
	if n := pings.Load(); n != 2 {
		t.Fatalf("the daemon saw %d pings, want 2 (the lost one not resent)", n)
	}
}

func TestFireAndForgetUnansweredWhenTheDaemonHangsUp(t *testing.T) {
	f := startFake(t, func(fc *fakeConn) {
		fc.read() // take one request, then hang up without answering
	})
	c := fakeClient(t, f, Options{PoolSize: 1})
	testwait.Eventually(t, "a connection", func() bool { return c.Counters().Connects == 1 })
	if _, err := c.Prefetch(context.Background(), paths(2), PrefetchOptions{}); err != nil {
		t.Fatal(err)
	}
	testwait.Eventually(t, "the loss to be counted", func() bool { return c.Counters().Lost == 1 })
}

func TestOversizeRequestIsRefusedBeforeSending(t *testing.T) {
	f := startFake(t, serve)
	c := fakeClient(t, f, Options{MaxFrameBytes: 1024})
	_, err := c.Prefetch(testwait.Within(t, 30*time.Second), paths(500), PrefetchOptions{Ack: true})
	if !errors.Is(err, ErrTooLarge) {
		t.Fatalf("ack: %v", err)
	}
	_, err = c.Prefetch(context.Background(), paths(500), PrefetchOptions{})
	if !errors.Is(err, ErrDropped) || !errors.Is(err, ErrTooLarge) {
		t.Fatalf("fire-and-forget: %v", err)
	}
}

func TestNoDaemonIsUnavailableWithTheReason(t *testing.T) {
	c, err := New(Options{SocketPath: filepath.Join(t.TempDir(), "absent.sock")})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	testwait.Eventually(t, "a failed dial", func() bool { return c.Counters().DialFailures > 0 })
	_, err = c.Prefetch(context.Background(), paths(1), PrefetchOptions{})
	if !errors.Is(err, ErrDropped) || !errors.Is(err, ErrUnavailable) {
		t.Fatalf("fire-and-forget: %v", err)
	}
	_, err = c.Ping(testwait.Within(t, 30*time.Millisecond))
	if !errors.Is(err, ErrUnavailable) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("ping: %v", err)
	}
	if want := "no such file or directory"; !strings.Contains(err.Error(), want) {
		t.Fatalf("the error should say why (%q): %v", want, err)
	}
}

func TestOptionsAreChecked(t *testing.T) {
	for _, o := range []Options{{PoolSize: -1}, {FireAndForgetTimeout: -time.Millisecond}} {
		if _, err := New(o); err == nil {
			t.Errorf("%+v accepted", o)
		}
	}
}

// idleConn is a connection without its goroutines, so nothing takes its calls but the test:
// each of calls is registered, those written marked as taken by the writer.
func idleConn(t *testing.T, calls []*call, written ...*call) (*conn, *counters) {
	fds, err := syscall.Socketpair(syscall.AF_UNIX, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Close(fds[1]) })
	f := os.NewFile(uintptr(fds[0]), "pair")
	nc, err := net.FileConn(f)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	opts, _ := Options{SocketPath: "pair", MaxInFlight: len(calls)}.withDefaults()
	stats := new(counters)
	c := &conn{
		nc: nc.(*net.UnixConn), opts: &opts, stats: stats,
		slots: make(chan struct{}, len(calls)), sendq: make(chan *call, len(calls)), done: make(chan struct{}),
		pending: make(map[uint64]*call),
	}
	for _, k := range calls {
		if !c.tryAcquire() {
			t.Fatal("no slot")
		}
		if err := c.send(k); err != nil {
			t.Fatal(err)
		}
	}
	for _, k := range written {
		k.state.Store(callTaken)
	}
	return c, stats
}

// When a connection ends, each call on it is settled by whether the writer had taken it:
// a sync call not yet written comes back as errNotSent (the client sends it elsewhere), a
// written one as ErrConnectionLost; a fire-and-forget one is Lost either way. A refusal
// answers every call alike.
func TestEndOfAConnectionSettlesEachCallByWhetherItWasWritten(t *testing.T) {
	queued := &call{id: 1, done: make(chan result, 1)}
	written := &call{id: 2, done: make(chan result, 1)}
	ffQueued := &call{id: 3, fireAndForget: true, paths: 7}
	ffWritten := &call{id: 4, fireAndForget: true}
	c, stats := idleConn(t, []*call{queued, written, ffQueued, ffWritten}, written, ffWritten)
	c.fail(errors.New("daemon went away"))

	if res := <-queued.done; res.err != errNotSent {
		t.Fatalf("queued call: %v, want errNotSent", res.err)
	}
	if res := <-written.done; !errors.Is(res.err, ErrConnectionLost) {
		t.Fatalf("written call: %v, want ErrConnectionLost", res.err)
	}
	if got := stats.snapshot(); got.Lost != 2 || got.Dropped != 0 {
		t.Fatalf("fire-and-forget calls: %+v", got)
	}
	if len(c.slots) != 0 {
		t.Fatalf("%d slots still held", len(c.slots))
	}
	if err := c.send(&call{id: 5}); err != errNotSent {
		t.Fatalf("send on an ended connection: %v", err)
	}
}

func TestARefusedConnectionAnswersEachCallWithTheRefusal(t *testing.T) {
	queued := &call{id: 1, done: make(chan result, 1)}
	written := &call{id: 2, done: make(chan result, 1)}
	ff := &call{id: 3, fireAndForget: true}
	c, stats := idleConn(t, []*call{queued, written, ff}, written)
	c.fail(&ServerError{Code: CodeForbidden, Message: "this user may not"})

	for _, k := range []*call{queued, written} {
		var se *ServerError
		if res := <-k.done; !errors.As(res.err, &se) || se.Code != CodeForbidden || se.RequestID != k.id {
			t.Fatalf("call %d: %v, want its refusal", k.id, res.err)
		}
	}
	if got := stats.snapshot(); got.Refused != 1 || got.Lost != 0 {
		t.Fatalf("fire-and-forget call: %+v", got)
	}
	if got := c.refusal(); got == nil || got.Code != CodeForbidden {
		t.Fatalf("the connection's refusal: %v", got)
	}
}
