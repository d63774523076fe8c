package kvprefetch

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The default socket chain's cases, shared with the daemon and the Python client
// (tests/unit/test_default_socket.py checks both against the same file).
type socketCase struct {
	Name    string            `json:"name"`
	Env     map[string]string `json:"env"`
	Systemd bool              `json:"systemd"`
	Socket  string            `json:"socket"`
}

func TestDefaultSocketFollowsTheDaemonsChain(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("testdata", "default_socket.json"))
	if err != nil {
		t.Fatal(err)
	}
	var vectors struct {
		Cases []socketCase `json:"cases"`
	}
	if err := json.Unmarshal(raw, &vectors); err != nil {
		t.Fatal(err)
	}
	if len(vectors.Cases) < 10 {
		t.Fatalf("only %d cases", len(vectors.Cases))
	}
	for _, c := range vectors.Cases {
		t.Run(c.Name, func(t *testing.T) {
			for _, name := range []string{"KVPREFETCHD_SOCKET", "RUNTIME_DIRECTORY", "XDG_RUNTIME_DIR"} {
				t.Setenv(name, "") // restored after the case
				if value, set := c.Env[name]; set {
					os.Setenv(name, value)
				} else {
					os.Unsetenv(name)
				}
			}
			systemd := filepath.Join(t.TempDir(), "kvprefetchd.sock")
			if c.Systemd {
				if err := os.WriteFile(systemd, nil, 0o600); err != nil {
					t.Fatal(err)
				}
			}
			want := strings.ReplaceAll(c.Socket, "@systemd", systemd)
			if got := defaultSocket(systemd); got != want {
				t.Fatalf("got %q, want %q", got, want)
			}
		})
	}
}
