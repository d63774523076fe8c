package kvprefetch

import (
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"time"
)

// SystemdSocket is where the systemd units put the daemon's socket.
const SystemdSocket = "/run/kvprefetchd/kvprefetchd.sock"

// Defaults for the zero values of Options.
const (
	DefaultPoolSize             = 2
	DefaultMaxInFlight          = 64
	DefaultFireAndForgetTimeout = time.Millisecond
	DefaultCallTimeout          = 5 * time.Second
	DefaultDialTimeout          = time.Second
	DefaultReconnectMin         = 10 * time.Millisecond
	DefaultReconnectMax         = 500 * time.Millisecond
)

// Options configure a Client. Zero values take the defaults above.
type Options struct {
	// SocketPath is where the daemon listens: its Unix socket (a path, or unix://PATH;
	// empty means DefaultSocket()), or tls://HOST:PORT, its TCP listener with mutual TLS
	// (TLSConfig required), or tcp://HOST:PORT (plaintext, which a daemon serves on
	// loopback only, for tests).
	SocketPath string
	// TLSConfig is for tls:// addresses: the client certificate (Certificates or
	// GetClientCertificate) and the CA that signed the daemon's (RootCAs). ServerName
	// defaults to the address's host.
	TLSConfig *tls.Config
	// PoolSize is how many connections the client keeps open. Requests are spread over
	// them, so one slow reply (a Wait) never queues the others behind it.
	PoolSize int
	// MaxInFlight bounds requests sent (or queued to send) and not yet answered, per
	// connection. It bounds the client's memory when the daemon falls behind: a
	// fire-and-forget request that finds every slot taken is dropped, not queued.
	MaxInFlight int
	// FireAndForgetTimeout is the longest a fire-and-forget Prefetch or PrefetchBlocks
	// waits for a connection and a free slot before dropping the request. It is the bound
	// on how long the router's request path can be held up, so keep it short.
	FireAndForgetTimeout time.Duration
	// CallTimeout bounds calls that wait for a reply when their context has no deadline.
	// A Wait's own Timeout is added to it.
	CallTimeout time.Duration
	// DialTimeout bounds one connection attempt.
	DialTimeout time.Duration
	// ReconnectMin and ReconnectMax bound the backoff between connection attempts while
	// the daemon is away (restarting, say); the delay doubles from Min up to Max, with
	// jitter so that many routers do not reconnect in step.
	ReconnectMin time.Duration
	ReconnectMax time.Duration
	// MaxFrameBytes refuses larger requests locally and larger replies as protocol errors;
	// keep it at the daemon's max_frame_bytes.
	MaxFrameBytes int

	endpoint endpoint // SocketPath, parsed
}

// endpoint is a parsed SocketPath.
type endpoint struct {
	kind    string // unix, tls or tcp
	address string // the path, or HOST:PORT
	host    string
}

func parseEndpoint(s string) (endpoint, error) {
	scheme, rest, found := strings.Cut(s, "://")
	if !found {
		return endpoint{kind: "unix", address: s}, nil
	}
	switch scheme {
	case "unix":
		return endpoint{kind: "unix", address: rest}, nil
	case "tls", "tcp":
		host, _, err := net.SplitHostPort(rest)
		if err != nil {
			return endpoint{}, fmt.Errorf("kvprefetch: %s: %w", s, err)
		}
		return endpoint{kind: scheme, address: rest, host: host}, nil
	}
	return endpoint{}, fmt.Errorf("kvprefetch: %s: unknown scheme %q (unix, tls or tcp)", s, scheme)
}

// DefaultSocket is the socket a daemon started with no configuration binds, found by the
// daemon's own chain (docs/configuration.md, "The default socket"; the Python client has
// the same, and testdata/default_socket.json holds all three to it): $KVPREFETCHD_SOCKET;
// the systemd path if it exists; kvprefetchd.sock in $RUNTIME_DIRECTORY, then
// $XDG_RUNTIME_DIR (the first entry, when absolute); /tmp/kvprefetchd.sock.
func DefaultSocket() string {
	return defaultSocket(SystemdSocket)
}

// defaultSocket is DefaultSocket with the systemd path given, so that a test can make it
// exist or not. Paths are joined as the daemon's os.path.join does: as given, not cleaned.
func defaultSocket(systemd string) string {
	if explicit := os.Getenv("KVPREFETCHD_SOCKET"); explicit != "" {
		return explicit
	}
	if _, err := os.Stat(systemd); err == nil {
		return systemd
	}
	for _, env := range []string{"RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"} {
		base, _, _ := strings.Cut(os.Getenv(env), ":")
		if strings.HasPrefix(base, "/") {
			if strings.HasSuffix(base, "/") {
				return base + "kvprefetchd.sock"
			}
			return base + "/kvprefetchd.sock"
		}
	}
	return "/tmp/kvprefetchd.sock"
}

// withDefaults checks the options and fills in the zero values.
func (o Options) withDefaults() (Options, error) {
	if o.PoolSize < 0 || o.MaxInFlight < 0 || o.MaxFrameBytes < 0 {
		return o, errors.New("kvprefetch: PoolSize, MaxInFlight and MaxFrameBytes must not be negative")
	}
	if o.FireAndForgetTimeout < 0 || o.CallTimeout < 0 || o.DialTimeout < 0 ||
		o.ReconnectMin < 0 || o.ReconnectMax < 0 {
		return o, errors.New("kvprefetch: timeouts must not be negative")
	}
	if o.SocketPath == "" {
		o.SocketPath = DefaultSocket()
	}
	ep, err := parseEndpoint(o.SocketPath)
	if err != nil {
		return o, err
	}
	if ep.kind == "tls" && o.TLSConfig == nil {
		return o, errors.New("kvprefetch: a tls:// address needs Options.TLSConfig")
	}
	o.endpoint = ep
	setDefault(&o.PoolSize, DefaultPoolSize)
	setDefault(&o.MaxInFlight, DefaultMaxInFlight)
	setDefault(&o.MaxFrameBytes, DefaultMaxFrameBytes)
	setDefault(&o.FireAndForgetTimeout, DefaultFireAndForgetTimeout)
	setDefault(&o.CallTimeout, DefaultCallTimeout)
	setDefault(&o.DialTimeout, DefaultDialTimeout)
	setDefault(&o.ReconnectMin, DefaultReconnectMin)
	setDefault(&o.ReconnectMax, DefaultReconnectMax)
	if o.ReconnectMax < o.ReconnectMin {
		o.ReconnectMax = o.ReconnectMin
	}
	return o, nil
}

func setDefault[T int | time.Duration](v *T, def T) {
	if *v == 0 {
		*v = def
	}
}
