// Package daemontest runs the real kvprefetchd for tests: a child process with its own
// socket, root and TOML config in a temporary directory, as bench/kvharness/daemon.py does
// for the Python tests. Nothing is mocked: the daemon forks real workers and reads real
// files.
//
// It deliberately does not import the client, so the client's tests cannot pass because
// of a shared mistake: readiness is checked with a hand-built ping frame.
package daemontest

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"
)

const (
	// BinEnv names the daemon executable (run-tests sets it: the repository's
	// .venv/bin/kvprefetchd, or kvprefetchd on PATH).
	BinEnv = "KVPREFETCHD_BIN"
	// RequireEnv=1 turns "no daemon" from a skip into a failure (CI sets it).
	RequireEnv = "KVPREFETCH_REQUIRE_DAEMON"

	startTimeout = 60 * time.Second // a shared 2-CPU machine under load is slow to fork
	stopTimeout  = 10 * time.Second // the daemon promises to be out within 5 s of SIGTERM
)

// Config is what a test may change in the daemon's configuration.
type Config struct {
	Workers   int // default 2
	ReadBytes int // default 64 KiB
	// Extra is more TOML appended after the top-level keys: tables such as [models.m.hash].
	// "{root}" in it stands for the daemon's allowed root.
	Extra string
}

// Daemon is one kvprefetchd child process and its directory.
type Daemon struct {
	Bin    string
	Dir    string // holds the socket, the config and the log
	Socket string
	Root   string // the only allowed root
	Config string
	log    string

	cmd    *exec.Cmd
	exited chan struct{}
	werr   error
}

// Binary returns the daemon to run, or skips t: a daemon test without a daemon cannot
// say anything. With KVPREFETCH_REQUIRE_DAEMON=1 (CI) it fails t instead.
func Binary(t testing.TB) string {
	t.Helper()
	bin, why := Lookup()
	if bin == "" {
		if os.Getenv(RequireEnv) == "1" {
			t.Fatalf("%s, and %s=1 requires it", why, RequireEnv)
		}
		t.Skip(why)
	}
	return bin
}

// Lookup returns the daemon executable, or "" and why there is none.
func Lookup() (string, string) {
	bin := os.Getenv(BinEnv)
	if bin == "" {
		return "", fmt.Sprintf("no kvprefetchd to test against: set %s (clients/go/run-tests finds the repository's .venv after ./dev test)", BinEnv)
	}
	if _, err := os.Stat(bin); err != nil {
		return "", fmt.Sprintf("%s=%s: %v", BinEnv, bin, err)
	}
	return bin, ""
}

// Start starts a daemon for t and stops it when t ends (printing its log if t failed).
func Start(t testing.TB, cfg Config) *Daemon {
	t.Helper()
	d, err := New(Binary(t), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("daemon log:\n%s", d.LogText())
		}
		if err := d.Close(); err != nil {
			t.Errorf("stopping the daemon: %v", err)
		}
	})
	if err := d.Start(); err != nil {
		t.Fatal(err)
	}
	return d
}

// New prepares a daemon's directory and config without starting it.
func New(bin string, cfg Config) (*Daemon, error) {
	// A short directory: a Unix socket path must fit in 108 bytes, and t.TempDir() names
	// grow with the test's name.
	dir, err := os.MkdirTemp("", "kvp-go-")
	if err != nil {
		return nil, err
	}
	d := &Daemon{
		Bin:    bin,
		Dir:    dir,
		Socket: filepath.Join(dir, "d.sock"),
		Root:   filepath.Join(dir, "kv"),
		Config: filepath.Join(dir, "config.toml"),
		log:    filepath.Join(dir, "daemon.log"),
	}
	if err := os.Mkdir(d.Root, 0o755); err != nil {
		return nil, err
	}
	if cfg.Workers == 0 {
		cfg.Workers = 2
	}
	if cfg.ReadBytes == 0 {
		cfg.ReadBytes = 64 << 10
	}
	// The pread engine: io_uring is often refused in containers, and the tests are about
	// the protocol, not the engine.
	toml := fmt.Sprintf("socket = %q\nroots = [%q]\nworkers = %d\nengine = \"pread\"\nread_bytes = %d\nlog_level = \"info\"\n",
		d.Socket, d.Root, cfg.Workers, cfg.ReadBytes)
	toml += strings.ReplaceAll(cfg.Extra, "{root}", d.Root)
	if err := os.WriteFile(d.Config, []byte(toml), 0o644); err != nil {
		return nil, err
	}
	return d, nil
}

// Start launches the daemon and waits until it answers a ping.
func (d *Daemon) Start() error {
	if d.cmd != nil && !d.stopped() {
		return errors.New("daemontest: already running")
	}
	logf, err := os.OpenFile(d.log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logf.Close()
	cmd := exec.Command(d.Bin, "--config", d.Config)
	cmd.Stdout, cmd.Stderr = logf, logf
	// Its own process group, so a daemon that ignores SIGTERM is killed with its workers.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		return err
	}
	d.cmd, d.exited, d.werr = cmd, make(chan struct{}), nil
	go func(exited chan struct{}) {
		d.werr = cmd.Wait()
		close(exited)
	}(d.exited)
	deadline := time.Now().Add(startTimeout)
	for {
		if d.stopped() {
			return fmt.Errorf("daemontest: kvprefetchd exited at start (%v):\n%s", d.werr, d.LogText())
		}
		if err := ping(d.Socket); err == nil {
			return nil
		} else if time.Now().After(deadline) {
			d.kill()
			return fmt.Errorf("daemontest: kvprefetchd did not answer within %s (%v):\n%s", startTimeout, err, d.LogText())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Stop sends SIGTERM and waits for the daemon to exit (SIGKILL after stopTimeout). An
// exit status other than 0 is an error: the daemon promises a clean stop.
func (d *Daemon) Stop() error {
	if d.cmd == nil || d.stopped() {
		return nil
	}
	_ = d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-d.exited:
	case <-time.After(stopTimeout):
		d.kill()
		return fmt.Errorf("daemontest: kvprefetchd ignored SIGTERM for %s; killed", stopTimeout)
	}
	if d.werr != nil {
		return fmt.Errorf("daemontest: kvprefetchd stopped with %v", d.werr)
	}
	return nil
}

// Restart stops the daemon and starts it again on the same socket and config.
func (d *Daemon) Restart() error {
	if err := d.Stop(); err != nil {
		return err
	}
	return d.Start()
}

// Close stops the daemon and removes its directory.
func (d *Daemon) Close() error {
	err := d.Stop()
	if rmErr := os.RemoveAll(d.Dir); err == nil {
		err = rmErr
	}
	return err
}

// LogText is everything the daemon wrote to stdout and stderr so far.
func (d *Daemon) LogText() string {
	b, err := os.ReadFile(d.log)
	if err != nil {
		return fmt.Sprintf("(no log: %v)", err)
	}
	return string(b)
}

// MakeFile writes a file of size bytes under the root (parents created) and returns its
// path.
func (d *Daemon) MakeFile(t testing.TB, rel string, size int) string {
	t.Helper()
	path := filepath.Join(d.Root, rel)
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, bytes.Repeat([]byte{0x5a}, size), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func (d *Daemon) stopped() bool {
	select {
	case <-d.exited:
		return true
	default:
		return false
	}
}

func (d *Daemon) kill() {
	_ = syscall.Kill(-d.cmd.Process.Pid, syscall.SIGKILL)
	<-d.exited
}

// ping sends one hand-built ping frame and checks the reply says ok.
func ping(socket string) error {
	conn, err := net.DialTimeout("unix", socket, time.Second)
	if err != nil {
		return err
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(5 * time.Second))
	payload, err := msgpack.Marshal(map[string]any{"v": 1, "id": 1, "op": "ping"})
	if err != nil {
		return err
	}
	frame := binary.BigEndian.AppendUint32(nil, uint32(len(payload)))
	if _, err := conn.Write(append(frame, payload...)); err != nil {
		return err
	}
	var header [4]byte
	if _, err := io.ReadFull(conn, header[:]); err != nil {
		return err
	}
	body := make([]byte, binary.BigEndian.Uint32(header[:]))
	if _, err := io.ReadFull(conn, body); err != nil {
		return err
	}
	var reply map[string]any
	if err := msgpack.Unmarshal(body, &reply); err != nil {
		return err
	}
	if reply["ok"] != true {
		return fmt.Errorf("ping answered %v", reply)
	}
	return nil
}
