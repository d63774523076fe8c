package main

// The mapping from the seed plugin's configuration, checked against the golden vectors
// the seed itself was run to produce (tests/vectors/, see its README), and against the
// real daemon.

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"testing"
	"time"

	kvprefetch "github.com/kvprefetchd/kvprefetchd/clients/go"
	"github.com/kvprefetchd/kvprefetchd/clients/go/internal/daemontest"
)

const vectors = "../../../../tests/vectors"

func loadVector(t *testing.T, name string, v any) {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join(vectors, name))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(raw, v); err != nil {
		t.Fatal(err)
	}
}

// The seed's PluginFactory was executed on these parameters; ours must default the same.
func TestSeedDefaultsAreAppliedAsThePluginDid(t *testing.T) {
	var vec struct {
		DefaultsCases []struct {
			ParametersJSON string `json:"parameters_json"`
			Expected       struct {
				KVFilePathBase      map[string]any `json:"kvFilePathBase"`
				PrefetchConfig      map[string]any `json:"prefetchConfig"`
				KVFilePathBaseIsSet bool           `json:"kvFilePathBase_IsSet"`
				WorkerPoolStarted   bool           `json:"worker_pool_started"`
			} `json:"expected"`
		} `json:"defaults_cases"`
	}
	loadVector(t, "prefetch_plugin_behaviour.json", &vec)
	if len(vec.DefaultsCases) == 0 {
		t.Fatal("no defaults cases")
	}
	for _, tc := range vec.DefaultsCases {
		var cfg Config
		if err := json.Unmarshal([]byte(tc.ParametersJSON), &cfg); err != nil {
			t.Fatal(err)
		}
		enabled, isSet := cfg.applySeedDefaults()
		if enabled != tc.Expected.WorkerPoolStarted || isSet != tc.Expected.KVFilePathBaseIsSet {
			t.Errorf("%s: enabled %v, path base set %v; the seed: %v, %v", tc.ParametersJSON, enabled, isSet,
				tc.Expected.WorkerPoolStarted, tc.Expected.KVFilePathBaseIsSet)
		}
		if got := asMap(t, cfg.KVFilePathBase); !reflect.DeepEqual(got, tc.Expected.KVFilePathBase) {
			t.Errorf("%s: kvFilePathBase %v, the seed %v", tc.ParametersJSON, got, tc.Expected.KVFilePathBase)
		}
		if got := asMap(t, cfg.PrefetchConfig); !reflect.DeepEqual(got, tc.Expected.PrefetchConfig) {
			t.Errorf("%s: prefetchConfig %v, the seed %v", tc.ParametersJSON, got, tc.Expected.PrefetchConfig)
		}
	}
}

// asMap is v as the JSON map the vectors record (nil for a nil pointer).
func asMap(t *testing.T, v any) map[string]any {
	t.Helper()
	raw, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(raw, &m); err != nil {
		t.Fatal(err)
	}
	return m
}

// For every layout the seed's configuration can express, the seed's own parameters,
// mapped by NewPlugin, make the daemon name exactly the files the fs connector writes.
// That includes dcp, where the seed itself named files that do not exist (spec §6.5).
func TestSeedParametersResolveToTheConnectorsFiles(t *testing.T) {
	var vec struct {
		Cases []struct {
			ID     string `json:"id"`
			Inputs struct {
				TokenIDs []uint32 `json:"token_ids"`
				Hash     struct {
					Algo           string `json:"algo"`
					PythonHashSeed string `json:"python_hash_seed"`
					VLLMBlockSize  int    `json:"vllm_block_size"`
				} `json:"hash"`
				KVCacheGroups []struct {
					BlockSize int `json:"block_size"`
				} `json:"kv_cache_groups"`
			} `json:"inputs"`
			Expected struct {
				Paths []struct {
					Path string `json:"path"`
				} `json:"paths"`
			} `json:"expected"`
			Seed struct {
				Parameters Config `json:"parameters"`
			} `json:"router_pr1156_comparison"`
		} `json:"cases"`
	}
	loadVector(t, "fs_connector_paths.json", &vec)
	d := daemontest.Start(t, daemontest.Config{})
	checked := 0
	for _, tc := range vec.Cases {
		sizes := map[int]bool{}
		for _, g := range tc.Inputs.KVCacheGroups {
			sizes[g.BlockSize] = true
		}
		if len(sizes) > 1 {
			// kvCacheGroupCount gives every group one block size: groups of different sizes
			// need a daemon profile (kvprefetchd.model), not the seed's configuration.
			t.Logf("%s: groups of different block sizes, not expressible in the seed's config", tc.ID)
			continue
		}
		cfg := tc.Seed.Parameters
		cfg.PrefetchConfig = &PrefetchConfig{Enabled: true}
		cfg.TokenProcessorConfig = TokenProcessorConfig{
			HashAlgorithm: tc.Inputs.Hash.Algo, HashSeed: tc.Inputs.Hash.PythonHashSeed, BlockSizeTokens: tc.Inputs.Hash.VLLMBlockSize,
		}
		cfg.KVPrefetchd.Socket = d.Socket
		p, err := NewPlugin(cfg)
		if err != nil {
			t.Fatalf("%s: %v", tc.ID, err)
		}
		req := p.template
		req.Prompts = []kvprefetch.Prompt{{TokenIDs: tc.Inputs.TokenIDs}}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		res, err := p.kv.Resolve(ctx, req)
		cancel()
		p.Close()
		if err != nil {
			t.Fatalf("%s: %v", tc.ID, err)
		}
		want := []string{}
		for _, p := range tc.Expected.Paths {
			want = append(want, p.Path)
		}
		if !reflect.DeepEqual(nonNil(res.Paths), want) {
			t.Errorf("%s: the daemon names\n%v\nthe connector writes\n%v", tc.ID, res.Paths, want)
		}
		checked++
	}
	if checked < 6 {
		t.Fatalf("only %d cases checked", checked)
	}
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

// PreRequest sends and returns; the daemon's answer shows in the counters.
func TestPreRequestIsFireAndForget(t *testing.T) {
	d := daemontest.Start(t, daemontest.Config{})
	var cfg Config
	if err := json.Unmarshal([]byte(exampleParams), &cfg); err != nil {
		t.Fatal(err)
	}
	cfg.KVFilePathBase.RootDir = d.Root
	cfg.KVPrefetchd.Socket = d.Socket
	cfg.KVPrefetchd.SendTimeout = "50ms" // the first call may come before the connection
	p, err := NewPlugin(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	if want := int64(4<<20) * 3; p.opts.ReadBytes != want || p.opts.Ack || p.opts.Wait {
		t.Fatalf("options: %+v, want ReadBytes %d and fire-and-forget", p.opts, want)
	}
	prompt := make([]uint32, 1024) // 16 blocks of 64 tokens: 2 files of 8 blocks
	for i := range prompt {
		prompt[i] = uint32(i)
	}
	if err := p.PreRequest(context.Background(), [][]uint32{prompt}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for p.Counters().Acked < 1 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if c := p.Counters(); c.Acked != 1 || c.FilesAccepted != 2 {
		t.Fatalf("counters: %+v", c)
	}

	// A request whose deadline passed before the daemon could start it: nothing is read.
	late, cancel := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer cancel()
	if got := p.options(late); !got.Deadline.IsZero() {
		t.Fatalf("the context's deadline should win: %+v", got)
	}
	if got := p.options(context.Background()); !got.Deadline.IsZero() {
		t.Fatalf("no deadline configured, none invented: %+v", got)
	}
	p.deadline = 2 * time.Second
	if got := p.options(context.Background()); time.Until(got.Deadline) <= time.Second {
		t.Fatalf("the configured deadline: %+v", got)
	}

	off, err := NewPlugin(Config{PrefetchConfig: &PrefetchConfig{Enabled: false}})
	if off != nil || err != nil {
		t.Fatalf("a disabled plugin: %v, %v", off, err)
	}
	if err := off.PreRequest(context.Background(), [][]uint32{prompt}); err != nil {
		t.Fatal(err)
	}
}

// The router warms the scheduled pod's node too: one call, two daemons, the node's over
// mutual TLS at an address made from the endpoint's host IP.
func TestPreRequestToWarmsTheGatewayAndTheNode(t *testing.T) {
	certs, err := daemontest.NewTLS(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := certs.Client("router", "spiffe://cluster.local/ns/llm-d/sa/router"); err != nil {
		t.Fatal(err)
	}
	port, err := daemontest.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	gateway := daemontest.Start(t, daemontest.Config{})
	node := daemontest.Start(t, daemontest.Config{
		Extra: certs.TCPConfig(port, "spiffe://cluster.local/ns/llm-d/sa/router")})
	var cfg Config
	if err := json.Unmarshal([]byte(exampleParams), &cfg); err != nil {
		t.Fatal(err)
	}
	cfg.KVFilePathBase.RootDir = gateway.Root
	cfg.KVPrefetchd.Socket = gateway.Socket
	cfg.KVPrefetchd.SendTimeout = "1s"
	cfg.KVPrefetchd.NodeDaemons = NodeDaemons{
		AddressTemplate: fmt.Sprintf("tls://{hostIP}:%d", port),
		CertFile:        filepath.Join(certs.Dir, "router.crt"),
		KeyFile:         filepath.Join(certs.Dir, "router.key"),
		CAFile:          certs.CAFile,
	}
	p, err := NewPlugin(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer p.Close()
	prompt := make([]uint32, 1024)
	if err := p.PreRequestTo(context.Background(), Endpoint{HostIP: "127.0.0.1"}, [][]uint32{prompt}); err != nil {
		t.Fatal(err)
	}
	toNode, err := p.nodes.client(Endpoint{HostIP: "127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for (p.Counters().Acked < 1 || toNode.Counters().Acked < 1) && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	// The gateway's root holds the layout's files; the node's daemon has another root
	// here, so it refuses them: what matters is that each was asked, once.
	if g, n := p.Counters(), toNode.Counters(); g.Acked != 1 || n.Acked != 1 || g.FilesAccepted != 2 {
		t.Fatalf("gateway %+v, node %+v", g, n)
	}
	_ = node
}
