package main

// The GPU nodes' daemons: the router knows the pod a request was scheduled to before the
// request reaches it (PreRequest runs after scheduling), so it can warm that pod's node
// as well as the shared tier. Each node runs kvprefetchd with its TCP listener on
// (deploy/kubernetes/gpu-node), reached over mutual TLS at an address made from the
// endpoint's host IP by a template.

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	kvprefetch "github.com/kvprefetchd/kvprefetchd/clients/go"
)

// NodeDaemons configures the reach to the GPU nodes' daemons (kvprefetchd.nodeDaemons).
type NodeDaemons struct {
	// AddressTemplate makes a node's daemon address from the scheduled endpoint:
	// "{hostIP}" is replaced by the pod's host IP, e.g. "tls://{hostIP}:7474".
	AddressTemplate string `json:"addressTemplate"`
	// The router's client certificate and key, and the CA that signed the daemons'
	// (a cert-manager Secret mounted into the router's pod).
	CertFile string `json:"certFile"`
	KeyFile  string `json:"keyFile"`
	CAFile   string `json:"caFile"`
	// MaxNodes bounds the clients kept (one per node, two connections each): a
	// node not asked for the longest is closed past it. Default 256.
	MaxNodes int `json:"maxNodes"`
}

// Endpoint is what the router's scheduler chose for a request.
type Endpoint struct {
	HostIP string // the pod's status.hostIP
}

// nodes keeps a client per node daemon.
type nodes struct {
	cfg     NodeDaemons
	send    time.Duration // kvprefetchd.sendTimeout: a new node's first request waits for its handshake this long
	tls     *tls.Config
	mu      sync.Mutex
	clients map[string]*kvprefetch.Client
	order   []string // least recently made first
}

func newNodes(cfg NodeDaemons, send time.Duration) (*nodes, error) {
	if cfg.AddressTemplate == "" {
		return nil, nil
	}
	if !strings.Contains(cfg.AddressTemplate, "{hostIP}") {
		return nil, errors.New("kvprefetchd.nodeDaemons.addressTemplate: needs {hostIP}")
	}
	if cfg.MaxNodes <= 0 {
		cfg.MaxNodes = 256
	}
	n := &nodes{cfg: cfg, send: send, clients: map[string]*kvprefetch.Client{}}
	if strings.HasPrefix(cfg.AddressTemplate, "tls://") {
		pair, err := tls.LoadX509KeyPair(cfg.CertFile, cfg.KeyFile)
		if err != nil {
			return nil, fmt.Errorf("kvprefetchd.nodeDaemons: %w", err)
		}
		pem, err := os.ReadFile(cfg.CAFile)
		if err != nil {
			return nil, fmt.Errorf("kvprefetchd.nodeDaemons.caFile: %w", err)
		}
		roots := x509.NewCertPool()
		if !roots.AppendCertsFromPEM(pem) {
			return nil, errors.New("kvprefetchd.nodeDaemons.caFile: no certificate in it")
		}
		n.tls = &tls.Config{Certificates: []tls.Certificate{pair}, RootCAs: roots, MinVersion: tls.VersionTLS12}
	}
	return n, nil
}

// client is the node's daemon client, made on first use.
func (n *nodes) client(e Endpoint) (*kvprefetch.Client, error) {
	if e.HostIP == "" {
		return nil, errors.New("the endpoint has no host IP")
	}
	address := strings.ReplaceAll(n.cfg.AddressTemplate, "{hostIP}", e.HostIP)
	n.mu.Lock()
	defer n.mu.Unlock()
	if c, ok := n.clients[address]; ok {
		return c, nil
	}
	c, err := kvprefetch.New(kvprefetch.Options{SocketPath: address, TLSConfig: n.tls,
		FireAndForgetTimeout: n.send})
	if err != nil {
		return nil, err
	}
	n.clients[address] = c
	n.order = append(n.order, address)
	if len(n.order) > n.cfg.MaxNodes {
		oldest := n.order[0]
		n.order = n.order[1:]
		go n.clients[oldest].Close()
		delete(n.clients, oldest)
	}
	return c, nil
}

func (n *nodes) close() {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, c := range n.clients {
		c.Close()
	}
	n.clients = map[string]*kvprefetch.Client{}
}

// PreRequestTo is PreRequest that also warms the scheduled endpoint's node: one
// fire-and-forget to the gateway's daemon (a read, which promotes the files on the shared
// tier) and one to the node's (which warms the page cache the inference engine reads;
// configure that daemon with warm_mode = "advise" where its file system honours
// POSIX_FADV_WILLNEED, see README "Warm the GPU node"), returning before either answers.
func (p *Plugin) PreRequestTo(ctx context.Context, e Endpoint, prompts [][]uint32) error {
	if p == nil {
		return nil
	}
	if p.nodes == nil {
		return p.PreRequest(ctx, prompts)
	}
	node, err := p.nodes.client(e)
	if err != nil {
		return err
	}
	req := kvprefetch.KVRequest{Model: p.template.Model, Hash: p.template.Hash, Layout: p.template.Layout}
	req.Prompts = make([]kvprefetch.Prompt, len(prompts))
	for i, tokens := range prompts {
		req.Prompts[i] = kvprefetch.Prompt{TokenIDs: tokens}
	}
	opts := p.options(ctx)
	kvprefetch.Fanout{Targets: []kvprefetch.FanoutTarget{
		{Client: p.kv, Options: opts}, {Client: node, Options: opts},
	}}.PrefetchBlocks(ctx, req)
	return nil
}
