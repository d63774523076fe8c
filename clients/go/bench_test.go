//go:build linux

package kvprefetch_test

// What a router's request path pays per call, against the real daemon:
//
//	clients/go/run-tests -run '^$' -bench . -benchtime 3000x
//
// Calls are paced (one every benchPace) as a router's would be, so the figures are of the
// send path rather than of a client that outruns the daemon and drops; ns/op is the mean
// call time, and the percentiles are of single calls. The cpu- figures are the calling
// thread's CPU time per call (the goroutine is locked to its thread): what the client
// itself costs, apart from the time the machine keeps the thread off a CPU. Figures only:
// nothing here asserts a time.

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"syscall"
	"testing"
	"time"
	"unsafe"

	kvprefetch "github.com/kvprefetchd/kvprefetchd/clients/go"
	"github.com/kvprefetchd/kvprefetchd/clients/go/internal/daemontest"
	"github.com/kvprefetchd/kvprefetchd/clients/go/internal/testwait"
)

const (
	benchPaths = 1000
	benchSets  = 64 // distinct path lists, so the daemon's dedup is not all it does
)

// benchPace is the interval between calls: 5 ms (200 requests, 200,000 paths a second)
// unless KVPREFETCH_BENCH_PACE says otherwise (a Go duration).
func benchPace(b *testing.B) time.Duration {
	pace := 5 * time.Millisecond
	if s := os.Getenv("KVPREFETCH_BENCH_PACE"); s != "" {
		var err error
		if pace, err = time.ParseDuration(s); err != nil {
			b.Fatalf("KVPREFETCH_BENCH_PACE: %v", err)
		}
	}
	return pace
}

// fsConnectorPaths makes n paths shaped as the fs connector names them
// (<root>/<model>_<fp12>_r<rank>/<h[0:3]>/<h[3:5]>_g<group>/<h>.bin), about 120 bytes each.
func fsConnectorPaths(b *testing.B, root string, n int) []string {
	paths := make([]string, n)
	raw := make([]byte, 32)
	for i := range paths {
		if _, err := rand.Read(raw); err != nil {
			b.Fatal(err)
		}
		h := hex.EncodeToString(raw)
		paths[i] = filepath.Join(root, "Qwen_Qwen3-8B_07d7b166f256_r0", h[:3], h[3:5]+"_g0", h+".bin")
	}
	return paths
}

func benchCalls(b *testing.B, opts kvprefetch.PrefetchOptions) {
	d := sharedDaemon(b)
	c := newClient(b, d.Socket, kvprefetch.Options{})
	if _, err := c.Ping(testwait.Within(b, 30*time.Second)); err != nil {
		b.Fatal(err)
	}
	sets := make([][]string, benchSets)
	for i := range sets {
		sets[i] = fsConnectorPaths(b, d.Root, benchPaths)
	}
	ctx := context.Background()
	pace := benchPace(b)
	took := make([]time.Duration, 0, b.N)
	cpu := make([]time.Duration, 0, b.N)
	errs := 0
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	next := time.Now()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if wait := time.Until(next); wait > 0 {
			time.Sleep(wait)
		}
		next = next.Add(pace)
		start, startCPU := time.Now(), threadCPU(b)
		_, err := c.Prefetch(ctx, sets[i%benchSets], opts)
		took = append(took, time.Since(start))
		cpu = append(cpu, threadCPU(b)-startCPU)
		if err != nil {
			errs++
		}
	}
	b.StopTimer()
	report(b, "", took)
	report(b, "cpu-", cpu)
	b.ReportMetric(float64(errs), "errors")
	if opts.Ack {
		return
	}
	// Let the acknowledgements in, so the counters say what became of the requests.
	deadline := time.Now().Add(10 * time.Second)
	for got := c.Counters(); got.Acked+got.Refused+got.Lost < got.Sent && time.Now().Before(deadline); got = c.Counters() {
		time.Sleep(10 * time.Millisecond)
	}
	got := c.Counters()
	b.ReportMetric(float64(got.Dropped), "dropped")
	b.Logf("%d calls: %+v", b.N, got)
}

// report gives the mean as ns/op (for the wall times), the median, p99 and maximum in
// microseconds, and how many calls took over 1 ms.
func report(b *testing.B, prefix string, took []time.Duration) {
	if len(took) == 0 {
		return
	}
	sort.Slice(took, func(i, j int) bool { return took[i] < took[j] })
	at := func(q float64) float64 {
		return float64(took[int(q*float64(len(took)-1))].Nanoseconds()) / 1e3
	}
	if prefix == "" {
		var sum time.Duration
		for _, t := range took {
			sum += t
		}
		b.ReportMetric(float64(sum.Nanoseconds())/float64(len(took)), "ns/op")
	}
	over := len(took) - sort.Search(len(took), func(i int) bool { return took[i] > time.Millisecond })
	b.ReportMetric(at(0.50), prefix+"p50-µs")
	b.ReportMetric(at(0.99), prefix+"p99-µs")
	b.ReportMetric(at(1), prefix+"max-µs")
	b.ReportMetric(float64(over), prefix+"over-1ms")
	b.Logf("%s%d calls of %d paths: p50 %.1f µs, p90 %.1f µs, p99 %.1f µs, p99.9 %.1f µs, max %.1f µs; %d over 1 ms",
		prefix, len(took), benchPaths, at(0.50), at(0.90), at(0.99), at(0.999), at(1), over)
}

// threadCPU is the CPU time of the calling thread (clock_gettime(CLOCK_THREAD_CPUTIME_ID)).
func threadCPU(b *testing.B) time.Duration {
	const clockThreadCPUTime = 3 // CLOCK_THREAD_CPUTIME_ID, <linux/time.h>
	var ts syscall.Timespec
	if _, _, errno := syscall.Syscall(syscall.SYS_CLOCK_GETTIME, clockThreadCPUTime, uintptr(unsafe.Pointer(&ts)), 0); errno != 0 {
		b.Fatal(errno)
	}
	return time.Duration(ts.Nano())
}

// BenchmarkPrefetchFireAndForget1000 is the router's call: encode 1,000 paths, hand the
// frame to a connection, return.
func BenchmarkPrefetchFireAndForget1000(b *testing.B) {
	benchCalls(b, kvprefetch.PrefetchOptions{})
}

// BenchmarkPrefetchAck1000 waits for the daemon's acknowledgement, for comparison: the
// round trip a router would pay if it did wait (bench/ack_latency.py measures the same
// from Python).
func BenchmarkPrefetchAck1000(b *testing.B) {
	benchCalls(b, kvprefetch.PrefetchOptions{Ack: true})
}

// BenchmarkFanout1000 is the router's fan-out: one call hands 1,000 paths to two daemons
// (the gateway's over the Unix socket, a node's over TLS) and returns; the target is
// well under 1 ms for the caller.
func BenchmarkFanout1000(b *testing.B) {
	certs, err := daemontest.NewTLS(b.TempDir())
	if err != nil {
		b.Fatal(err)
	}
	port, err := daemontest.FreePort()
	if err != nil {
		b.Fatal(err)
	}
	node := daemontest.Start(b, daemontest.Config{Extra: certs.TCPConfig(port, routerID)})
	gateway := daemontest.Start(b, daemontest.Config{})
	cfg, err := certs.Client("router", routerID)
	if err != nil {
		b.Fatal(err)
	}
	toNode := newClient(b, fmt.Sprintf("tls://127.0.0.1:%d", port), kvprefetch.Options{TLSConfig: cfg})
	toGateway := newClient(b, gateway.Socket, kvprefetch.Options{})
	ctx := context.Background()
	for _, c := range []*kvprefetch.Client{toNode, toGateway} {
		if _, err := c.Ping(ctx); err != nil {
			b.Fatal(err)
		}
	}
	paths := make([]string, benchPaths)
	for i := range paths {
		paths[i] = fmt.Sprintf("%s/bench/%064x.bin", node.Root, i)
	}
	fan := kvprefetch.Fanout{Targets: []kvprefetch.FanoutTarget{{Client: toGateway}, {Client: toNode}}}
	took := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		start := time.Now()
		fan.Prefetch(ctx, paths)
		took = append(took, time.Since(start))
		time.Sleep(200 * time.Microsecond) // a router's pace, not a flood
	}
	b.StopTimer()
	report(b, "", took)
	b.Logf("node %+v; gateway %+v", toNode.Counters(), toGateway.Counters())
}
