package kvprefetch_test

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	kvprefetch "github.com/kvprefetchd/kvprefetchd/clients/go"
	"github.com/kvprefetchd/kvprefetchd/clients/go/internal/daemontest"
	"github.com/kvprefetchd/kvprefetchd/clients/go/internal/testwait"
)

const routerID = "spiffe://cluster.local/ns/llm-d/sa/router"

// tlsDaemon is a daemon with its TCP listener on, and the address to dial.
func tlsDaemon(t *testing.T) (*daemontest.Daemon, *daemontest.TLS, string) {
	t.Helper()
	certs, err := daemontest.NewTLS(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	port, err := daemontest.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	d := daemontest.Start(t, daemontest.Config{Extra: certs.TCPConfig(port, routerID)})
	return d, certs, fmt.Sprintf("tls://127.0.0.1:%d", port)
}

func TestTLSClientGetsTheProtocol(t *testing.T) {
	d, certs, address := tlsDaemon(t)
	cfg, err := certs.Client("router", routerID)
	if err != nil {
		t.Fatal(err)
	}
	c := newClient(t, address, kvprefetch.Options{TLSConfig: cfg})
	ctx := testwait.Within(t, 30*time.Second)
	if _, err := c.Ping(ctx); err != nil {
		t.Fatal(err)
	}
	files := []string{d.MakeFile(t, "tls/a.bin", 4096), d.MakeFile(t, "tls/b.bin", 4096)}
	done, err := c.Prefetch(ctx, files, kvprefetch.PrefetchOptions{Wait: true})
	if err != nil || done.Accepted != 2 || done.Outcomes[kvprefetch.OutcomeRead]+done.Outcomes[kvprefetch.OutcomeResident] != 2 {
		t.Fatalf("over TLS: %+v, %v", done, err)
	}
}

func TestTLSClientNotListedIsForbidden(t *testing.T) {
	_, certs, address := tlsDaemon(t)
	cfg, err := certs.Client("intruder", "spiffe://cluster.local/ns/x/sa/intruder")
	if err != nil {
		t.Fatal(err)
	}
	c := newClient(t, address, kvprefetch.Options{TLSConfig: cfg})
	_, err = c.Ping(testwait.Within(t, 30*time.Second))
	var se *kvprefetch.ServerError
	if !errors.As(err, &se) || se.Code != kvprefetch.CodeForbidden {
		t.Fatalf("an unlisted client: %v", err)
	}
}

func TestTLSAddressNeedsAConfig(t *testing.T) {
	if _, err := kvprefetch.New(kvprefetch.Options{SocketPath: "tls://127.0.0.1:1"}); err == nil {
		t.Fatal("tls:// without TLSConfig accepted")
	}
	if _, err := kvprefetch.New(kvprefetch.Options{SocketPath: "ftp://x:1"}); err == nil {
		t.Fatal("an unknown scheme accepted")
	}
}

// The router's fan-out: one prefetch to the gateway's daemon (Unix socket here) and to
// the GPU node's (TLS), returning before either answers.
func TestFanoutReachesEveryDaemon(t *testing.T) {
	node, certs, address := tlsDaemon(t)
	gateway := daemontest.Start(t, daemontest.Config{})
	cfg, err := certs.Client("router", routerID)
	if err != nil {
		t.Fatal(err)
	}
	toNode := newClient(t, address, kvprefetch.Options{TLSConfig: cfg, FireAndForgetTimeout: time.Second})
	toGateway := newClient(t, gateway.Socket, kvprefetch.Options{FireAndForgetTimeout: time.Second})
	ctx := testwait.Within(t, 30*time.Second)
	for _, c := range []*kvprefetch.Client{toNode, toGateway} {
		if _, err := c.Ping(ctx); err != nil { // connected: the fan-out's requests go at once
			t.Fatal(err)
		}
	}
	nodeFile, gatewayFile := node.MakeFile(t, "f.bin", 4096), gateway.MakeFile(t, "f.bin", 4096)
	_ = gatewayFile // the same relative name under each daemon's root
	fan := kvprefetch.Fanout{Targets: []kvprefetch.FanoutTarget{
		{Client: toGateway}, {Client: toNode},
	}}
	request, cancel := context.WithTimeout(context.Background(), time.Minute)
	fan.Prefetch(request, []string{nodeFile, gateway.Root + "/f.bin"})
	cancel() // the router's request may end at once: the sends are not recalled
	for _, c := range []*kvprefetch.Client{toNode, toGateway} {
		for c.Counters().Acked < 1 {
			if ctx.Err() != nil {
				t.Fatalf("a fan-out target never acknowledged: %+v", c.Counters())
			}
			time.Sleep(5 * time.Millisecond)
		}
		if got := c.Counters(); got.FilesAccepted != 1 || got.FilesRejected != 1 {
			t.Fatalf("each daemon takes its own root's file and rejects the other's: %+v", got)
		}
	}
}

// TestFanoutAcrossNamespaces is the router's fan-out between hosts: run by
// tests/integration/test_tls_netns.py inside the router's network namespace, with the
// gateway's daemon on a Unix socket and a GPU node's across a veth pair (through a relay
// that adds a round trip), both named by the environment. Skipped anywhere else.
func TestFanoutAcrossNamespaces(t *testing.T) {
	gatewaySocket, nodeAddress := os.Getenv("KVP_NETNS_GATEWAY"), os.Getenv("KVP_NETNS_NODE")
	if gatewaySocket == "" || nodeAddress == "" {
		t.Skip("run by tests/integration/test_tls_netns.py")
	}
	pair, err := tls.LoadX509KeyPair(os.Getenv("KVP_NETNS_CERT"), os.Getenv("KVP_NETNS_KEY"))
	if err != nil {
		t.Fatal(err)
	}
	pem, err := os.ReadFile(os.Getenv("KVP_NETNS_CA"))
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(pem)
	cfg := &tls.Config{Certificates: []tls.Certificate{pair}, RootCAs: roots}
	toNode := newClient(t, nodeAddress, kvprefetch.Options{TLSConfig: cfg})
	toGateway := newClient(t, gatewaySocket, kvprefetch.Options{})
	ctx := testwait.Within(t, 60*time.Second)
	for _, c := range []*kvprefetch.Client{toNode, toGateway} {
		if _, err := c.Ping(ctx); err != nil {
			t.Fatal(err)
		}
	}
	fan := kvprefetch.Fanout{Targets: []kvprefetch.FanoutTarget{{Client: toGateway}, {Client: toNode}}}
	paths := strings.Split(os.Getenv("KVP_NETNS_PATHS"), ",")
	var slowest time.Duration
	for i := 0; i < 100; i++ {
		start := time.Now()
		fan.Prefetch(ctx, paths)
		if took := time.Since(start); took > slowest {
			slowest = took
		}
	}
	for _, c := range []*kvprefetch.Client{toNode, toGateway} {
		for c.Counters().Acked < 100 {
			if ctx.Err() != nil {
				t.Fatalf("acks missing: %+v", c.Counters())
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	t.Logf("100 fan-outs: the slowest took %v for the caller; node %+v; gateway %+v",
		slowest, toNode.Counters(), toGateway.Counters())
}
