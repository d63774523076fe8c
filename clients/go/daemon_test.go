package kvprefetch_test

// The client against the real daemon (internal/daemontest starts it). Most tests share one
// daemon, started on first use, each with its own client so that Counters are its own;
// the restart test has a daemon to itself.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"sync"
	"syscall"
	"testing"
	"time"

	kvprefetch "github.com/kvprefetchd/kvprefetchd/clients/go"
	"github.com/kvprefetchd/kvprefetchd/clients/go/internal/daemontest"
	"github.com/kvprefetchd/kvprefetchd/clients/go/internal/testwait"
)

// A model profile as the daemon's config knows it (the same one the Python KV tests use):
// 16-token blocks, 32-token connector files, two ranks.
const modelProfile = `
[models.m.hash]
algo = "sha256_cbor"
python_hash_seed = "0"
block_size = 16
vllm_version = "0.23.0"

[models.m.layout]
root_dir = "{root}"
model_name = "org/model"
tp_size = 2
connector_block_size_tokens = 32
fingerprint = "0123456789ab"
kv_cache_groups = [{block_size = 16}]
`

var shared struct {
	once sync.Once
	d    *daemontest.Daemon
	err  error
}

// sharedDaemon is the daemon most tests use, started once.
func sharedDaemon(t testing.TB) *daemontest.Daemon {
	t.Helper()
	bin := daemontest.Binary(t)
	shared.once.Do(func() {
		shared.d, shared.err = daemontest.New(bin, daemontest.Config{Extra: modelProfile})
		if shared.err == nil {
			shared.err = shared.d.Start()
		}
	})
	if shared.err != nil {
		t.Fatal(shared.err)
	}
	return shared.d
}

func TestMain(m *testing.M) {
	code := m.Run()
	if shared.d != nil {
		if err := shared.d.Close(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			if code == 0 {
				code = 1
			}
		}
	}
	os.Exit(code)
}

func newClient(t testing.TB, socket string, opts kvprefetch.Options) *kvprefetch.Client {
	t.Helper()
	opts.SocketPath = socket
	c, err := kvprefetch.New(opts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

func TestPing(t *testing.T) {
	d := sharedDaemon(t)
	c := newClient(t, d.Socket, kvprefetch.Options{})
	ping, err := c.Ping(testwait.Within(t, 30*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	if ping.Protocol != kvprefetch.ProtocolVersion || ping.Workers != 2 || ping.Engine != "pread" || ping.Version == "" {
		t.Fatalf("unexpected ping: %+v", ping)
	}
}

func TestFireAndForgetPrefetchIsAckedAndCounted(t *testing.T) {
	d := sharedDaemon(t)
	c := newClient(t, d.Socket, kvprefetch.Options{})
	if _, err := c.Ping(testwait.Within(t, 30*time.Second)); err != nil { // connected before timing matters
		t.Fatal(err)
	}
	paths := []string{"/etc/passwd"} // outside the root: rejected before any I/O
	for i := 0; i < 5; i++ {
		paths = append(paths, d.MakeFile(t, fmt.Sprintf("ff/%d.bin", i), 4096))
	}
	res, err := c.Prefetch(context.Background(), paths, kvprefetch.PrefetchOptions{})
	if err != nil {
		t.Fatalf("fire-and-forget prefetch: %v", err)
	}
	if res.Accepted != 0 || res.Outcomes != nil {
		t.Fatalf("fire-and-forget returns no result, got %+v", res)
	}
	testwait.Eventually(t, "the acknowledgement", func() bool { return c.Counters().Acked == 1 })
	got := c.Counters()
	if got.Sent != 1 || got.Dropped != 0 || got.FilesAccepted != 5 || got.FilesRejected != 1 || got.FilesDropped != 0 {
		t.Fatalf("counters after one fire-and-forget prefetch: %+v", got)
	}
}

func TestAckAndWaitReturnTheDaemonsCounts(t *testing.T) {
	d := sharedDaemon(t)
	c := newClient(t, d.Socket, kvprefetch.Options{})
	ctx := testwait.Within(t, 30*time.Second)
	files := []string{d.MakeFile(t, "wait/a.bin", 100<<10), d.MakeFile(t, "wait/b.bin", 1000)}
	absent := filepath.Join(d.Root, "wait/absent.bin")

	ack, err := c.Prefetch(ctx, append(files, "relative/path"), kvprefetch.PrefetchOptions{Ack: true})
	if err != nil {
		t.Fatal(err)
	}
	if ack.Accepted != 2 || ack.Rejected != 1 || ack.Dropped != 0 || ack.Outcomes != nil {
		t.Fatalf("ack: %+v", ack)
	}

	done, err := c.Prefetch(ctx, append(files, absent), kvprefetch.PrefetchOptions{Wait: true, ReadBytes: 4096})
	if err != nil {
		t.Fatal(err)
	}
	o := done.Outcomes
	if done.Accepted != 3 || o == nil || o[kvprefetch.OutcomeRead]+o[kvprefetch.OutcomeResident] != 2 || o[kvprefetch.OutcomeMissing] != 1 {
		t.Fatalf("wait: %+v", done)
	}
	if done.Elapsed <= 0 {
		t.Fatalf("wait without elapsed time: %+v", done)
	}
	sum := 0
	for _, n := range o {
		sum += n
	}
	if sum != done.Accepted {
		t.Fatalf("outcomes %v do not add up to accepted %d", o, done.Accepted)
	}

	// An explicit Timeout rides along as timeout_ms.
	timed, err := c.Prefetch(ctx, files, kvprefetch.PrefetchOptions{Wait: true, Timeout: 10 * time.Second})
	if err != nil || timed.Accepted != 2 || timed.Outcomes == nil {
		t.Fatalf("wait with timeout: %+v, %v", timed, err)
	}
}

func TestNonUTF8PathTravelsAsBin(t *testing.T) {
	d := sharedDaemon(t)
	c := newClient(t, d.Socket, kvprefetch.Options{})
	path := d.MakeFile(t, "bin/caf\xe9.bin", 8192) // Latin-1 é: not UTF-8
	res, err := c.Prefetch(testwait.Within(t, 30*time.Second), []string{path}, kvprefetch.PrefetchOptions{Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	if res.Accepted != 1 || res.Outcomes[kvprefetch.OutcomeRead]+res.Outcomes[kvprefetch.OutcomeResident] != 1 {
		t.Fatalf("a non-UTF-8 path was not warmed: %+v", res)
	}
}

func TestServerErrorsAreTypedAndTheConnectionGoesOn(t *testing.T) {
	d := sharedDaemon(t)
	c := newClient(t, d.Socket, kvprefetch.Options{PoolSize: 1})
	ctx := testwait.Within(t, 30*time.Second)
	_, err := c.Prefetch(ctx, []string{filepath.Join(d.Root, "x")}, kvprefetch.PrefetchOptions{Ack: true, ReadBytes: 1 << 40})
	var se *kvprefetch.ServerError
	if !errors.As(err, &se) || se.Code != kvprefetch.CodeBadRequest || se.Message == "" {
		t.Fatalf("want a bad_request ServerError, got %v", err)
	}
	_, err = c.Resolve(ctx, kvprefetch.KVRequest{Model: "no-such-model", Prompts: []kvprefetch.Prompt{{TokenIDs: []uint32{1}}}})
	if !errors.As(err, &se) || se.Code != kvprefetch.CodeBadRequest {
		t.Fatalf("want a bad_request ServerError for an unknown model, got %v", err)
	}
	if _, err := c.Ping(ctx); err != nil {
		t.Fatalf("ping after errors: %v", err)
	}
	// A refused fire-and-forget request is counted, not returned.
	if _, err := c.Prefetch(ctx, []string{"/x"}, kvprefetch.PrefetchOptions{ReadBytes: 1 << 40}); err != nil {
		t.Fatal(err)
	}
	testwait.Eventually(t, "the refusal", func() bool { return c.Counters().Refused == 1 })
	if n := c.Counters().Connects; n != 1 {
		t.Fatalf("errors must not cost the connection: %d connects", n)
	}
}

// twoPrompts map to 2 prompts x 3 files of 32 tokens x 2 ranks = 12 paths under modelProfile.
var twoPrompts = []kvprefetch.Prompt{{TokenIDs: seq(0, 100)}, {TokenIDs: seq(50, 150)}}

func seq(from, to uint32) []uint32 {
	s := make([]uint32, 0, to-from)
	for i := from; i < to; i++ {
		s = append(s, i)
	}
	return s
}

func TestResolveThenPrefetchBlocksByModel(t *testing.T) {
	d := sharedDaemon(t)
	c := newClient(t, d.Socket, kvprefetch.Options{})
	ctx := testwait.Within(t, 30*time.Second)
	res, err := c.Resolve(ctx, kvprefetch.KVRequest{Model: "m", Prompts: twoPrompts})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Paths) != 12 || len(res.BlockHashes) != 2 || len(res.BlockHashes[0]) != 6 || res.Fingerprint != "0123456789ab" {
		t.Fatalf("resolve: %d paths, hashes %v, fingerprint %q", len(res.Paths), res.BlockHashes, res.Fingerprint)
	}
	for _, h := range res.BlockHashes[0] {
		if len(h) != 64 {
			t.Fatalf("block hash %q is not 32 bytes of hex", h)
		}
	}
	written := res.Paths[:10] // the last two files were never offloaded
	for _, p := range written {
		rel, err := filepath.Rel(d.Root, p)
		if err != nil {
			t.Fatal(err)
		}
		d.MakeFile(t, rel, 8192)
	}
	done, err := c.PrefetchBlocks(ctx, kvprefetch.BlocksRequest{
		KVRequest:       kvprefetch.KVRequest{Model: "m", Prompts: twoPrompts},
		PrefetchOptions: kvprefetch.PrefetchOptions{Wait: true},
	})
	if err != nil {
		t.Fatal(err)
	}
	o := done.Outcomes
	if done.Files != 12 || done.Accepted != 12 || o[kvprefetch.OutcomeRead]+o[kvprefetch.OutcomeResident] != 10 || o[kvprefetch.OutcomeMissing] != 2 {
		t.Fatalf("prefetch_blocks: %+v", done)
	}

	// The router's way: fire and forget.
	if _, err := c.PrefetchBlocks(ctx, kvprefetch.BlocksRequest{KVRequest: kvprefetch.KVRequest{Model: "m", Prompts: twoPrompts}}); err != nil {
		t.Fatal(err)
	}
	testwait.Eventually(t, "the acknowledgement", func() bool { return c.Counters().Acked == 1 })
	if got := c.Counters().FilesAccepted; got != 12 {
		t.Fatalf("fire-and-forget prefetch_blocks: %d files accepted, want 12", got)
	}
}

func TestPrefetchBlocksWithInlineProfileAndBlockHashes(t *testing.T) {
	d := sharedDaemon(t)
	c := newClient(t, d.Socket, kvprefetch.Options{})
	seed := "0"
	hashes := make([][]byte, 4)
	for i := range hashes {
		hashes[i] = make([]byte, 32)
		for j := range hashes[i] {
			hashes[i][j] = byte(i)
		}
	}
	req := kvprefetch.KVRequest{
		Hash: &kvprefetch.HashSpec{Algo: "sha256_cbor", PythonHashSeed: &seed, BlockSize: 16, VLLMVersion: "0.23.0"},
		Layout: &kvprefetch.Layout{
			RootDir: d.Root, ModelName: "org/model", TPSize: 2, Fingerprint: "0123456789ab",
			KVCacheGroups: []kvprefetch.KVCacheGroup{{BlockSize: 16}}, ConnectorBlockSizeTokens: 32,
		},
		BlockHashes: [][][]byte{hashes},
	}
	ack, err := c.PrefetchBlocks(testwait.Within(t, 30*time.Second), kvprefetch.BlocksRequest{KVRequest: req, PrefetchOptions: kvprefetch.PrefetchOptions{Ack: true}})
	if err != nil {
		t.Fatal(err)
	}
	if ack.Files != 4 || ack.Accepted != 4 { // every 2nd hash names a file, on 2 ranks
		t.Fatalf("prefetch_blocks with block hashes: %+v", ack)
	}
	res, err := c.Resolve(testwait.Within(t, 30*time.Second), req)
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Paths) != 4 || len(res.BlockHashes) != 1 || res.BlockHashes[0][1] != fmt.Sprintf("%064x", hashes[1]) {
		t.Fatalf("resolve with block hashes: %+v", res)
	}
}

// Every extra-key field of a prompt (cache salt, the empty salt, LoRA, multimodal items)
// reaches the daemon as vLLM's hashing needs it: the block hashes it computes from the Go
// client's request are the golden vectors' (made by running vLLM itself).
func TestPromptFieldsHashAsTheVectorsSay(t *testing.T) {
	d := sharedDaemon(t)
	c := newClient(t, d.Socket, kvprefetch.Options{})
	checked := 0
	for _, era := range []string{"A", "B", "B2", "C"} {
		var vec struct {
			Versions []string `json:"valid_for_vllm_versions"`
			Cases    []struct {
				ID     string `json:"id"`
				Inputs struct {
					Request struct {
						TokenIDs   []uint32               `json:"token_ids"`
						CacheSalt  *string                `json:"cache_salt"`
						LoRA       *kvprefetch.LoRA       `json:"lora"`
						MMFeatures []kvprefetch.MMFeature `json:"mm_features"`
					} `json:"request"`
					Hash struct {
						Algo           string  `json:"algo"`
						PythonHashSeed *string `json:"python_hash_seed"`
						BlockSize      int     `json:"block_size"`
					} `json:"hash"`
				} `json:"inputs"`
				Expected struct {
					BlockHashesHex []string `json:"block_hashes_hex"`
				} `json:"expected"`
			} `json:"cases"`
		}
		raw, err := os.ReadFile(filepath.Join("..", "..", "tests", "vectors", "sha256_cbor_extras_era"+era+".json"))
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(raw, &vec); err != nil {
			t.Fatal(err)
		}
		for _, tc := range vec.Cases {
			in := tc.Inputs
			res, err := c.Resolve(testwait.Within(t, 30*time.Second), kvprefetch.KVRequest{
				Hash: &kvprefetch.HashSpec{Algo: in.Hash.Algo, PythonHashSeed: in.Hash.PythonHashSeed, BlockSize: in.Hash.BlockSize, VLLMVersion: vec.Versions[0]},
				Layout: &kvprefetch.Layout{RootDir: d.Root, ModelName: "org/model", Fingerprint: "0123456789ab",
					KVCacheGroups: []kvprefetch.KVCacheGroup{{BlockSize: in.Hash.BlockSize}}, ConnectorBlockSizeTokens: in.Hash.BlockSize},
				Prompts: []kvprefetch.Prompt{{TokenIDs: in.Request.TokenIDs, CacheSalt: in.Request.CacheSalt, LoRA: in.Request.LoRA, MMFeatures: in.Request.MMFeatures}},
			})
			if err != nil {
				t.Fatalf("era %s, %s: %v", era, tc.ID, err)
			}
			if len(res.BlockHashes) != 1 || !reflect.DeepEqual(res.BlockHashes[0], tc.Expected.BlockHashesHex) {
				t.Errorf("era %s, %s: hashes %v, want %v", era, tc.ID, res.BlockHashes, tc.Expected.BlockHashesHex)
			}
			checked++
		}
	}
	if checked < 20 {
		t.Fatalf("only %d cases checked", checked)
	}
}

func TestStats(t *testing.T) {
	d := sharedDaemon(t)
	c := newClient(t, d.Socket, kvprefetch.Options{})
	ctx := testwait.Within(t, 30*time.Second)
	if _, err := c.Prefetch(ctx, []string{filepath.Join(d.Root, "s.bin")}, kvprefetch.PrefetchOptions{Ack: true}); err != nil {
		t.Fatal(err)
	}
	stats, err := c.Stats(ctx)
	if err != nil {
		t.Fatal(err)
	}
	files, ok := stats["files"].(map[string]any)
	if !ok {
		t.Fatalf("stats without a files map: %v", stats)
	}
	if accepted, ok := files["accepted"].(int64); !ok || accepted < 1 {
		t.Fatalf("stats.files.accepted = %#v", files["accepted"])
	}
	if workers, ok := stats["workers"].([]any); !ok || len(workers) != 2 {
		t.Fatalf("stats.workers = %#v", stats["workers"])
	}
	if _, ok := stats["uptime_s"].(float64); !ok {
		t.Fatalf("stats.uptime_s = %#v", stats["uptime_s"])
	}
}

// Doctor's report on the shared daemon's local root: open and useful.
func TestDoctor(t *testing.T) {
	d := sharedDaemon(t)
	c := newClient(t, d.Socket, kvprefetch.Options{})
	ctx := testwait.Within(t, 30*time.Second)
	report, err := c.Doctor(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if useful, ok := report["useful"].(bool); !ok || !useful {
		t.Fatalf("doctor.useful = %#v", report["useful"])
	}
	host, ok := report["host"].(map[string]any)
	if !ok || host["engine"] == nil {
		t.Fatalf("doctor.host = %#v", report["host"])
	}
	roots, ok := report["roots"].([]any)
	if !ok || len(roots) != 1 {
		t.Fatalf("doctor.roots = %#v", report["roots"])
	}
	root, ok := roots[0].(map[string]any)
	if !ok || root["root"] != d.Root || root["status"] != "open" || root["useful"] != true {
		t.Fatalf("doctor.roots[0] = %#v", roots[0])
	}
	if _, ok := root["problems"].([]any); !ok {
		t.Fatalf("doctor.roots[0].problems = %#v", root["problems"])
	}
}

// Many goroutines share one connection with few slots: every reply reaches its own caller.
func TestPipelinedCallsOnOneConnection(t *testing.T) {
	d := sharedDaemon(t)
	c := newClient(t, d.Socket, kvprefetch.Options{PoolSize: 1, MaxInFlight: 4})
	ctx := testwait.Within(t, 60*time.Second)
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for g := 0; g < 32; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			paths := make([]string, g+1) // the count tells whose reply it is
			for i := range paths {
				paths[i] = filepath.Join(d.Root, fmt.Sprintf("pipe/%d/%d", g, i))
			}
			res, err := c.Prefetch(ctx, paths, kvprefetch.PrefetchOptions{Ack: true})
			if err == nil && res.Accepted != g+1 {
				err = fmt.Errorf("goroutine %d got %d accepted: someone else's reply", g, res.Accepted)
			}
			if err == nil {
				_, err = c.Ping(ctx)
			}
			errs <- err
		}(g)
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	if got := c.Counters(); got.Connects != 1 || got.Late != 0 {
		t.Fatalf("counters: %+v", got)
	}
}

func TestDaemonRestartMidTest(t *testing.T) {
	d := daemontest.Start(t, daemontest.Config{})
	c := newClient(t, d.Socket, kvprefetch.Options{PoolSize: 2})
	if _, err := c.Ping(testwait.Within(t, 30*time.Second)); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(d.Root, "restart.bin")
	if _, err := c.Prefetch(context.Background(), []string{path}, kvprefetch.PrefetchOptions{}); err != nil {
		t.Fatal(err)
	}
	testwait.Eventually(t, "the first acknowledgement", func() bool { return c.Counters().Acked == 1 })
	testwait.Eventually(t, "both connections", func() bool { return c.Counters().Connects == 2 })

	if err := d.Stop(); err != nil {
		t.Fatal(err)
	}
	testwait.Eventually(t, "the client to see the daemon go", func() bool { return c.Counters().Disconnects == 2 })

	// While it is away: fire-and-forget drops at once (counted), waiting calls time out.
	_, err := c.Prefetch(context.Background(), []string{path, path}, kvprefetch.PrefetchOptions{})
	if !errors.Is(err, kvprefetch.ErrDropped) || !errors.Is(err, kvprefetch.ErrUnavailable) {
		t.Fatalf("fire-and-forget with the daemon down: %v", err)
	}
	if got := c.Counters(); got.Dropped != 1 || got.DroppedPaths != 2 {
		t.Fatalf("drop not counted: %+v", got)
	}
	_, err = c.Ping(testwait.Within(t, 50*time.Millisecond))
	if !errors.Is(err, kvprefetch.ErrUnavailable) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("ping with the daemon down: %v", err)
	}
	testwait.Eventually(t, "failed redials", func() bool { return c.Counters().DialFailures > 0 })

	if err := d.Start(); err != nil {
		t.Fatal(err)
	}
	// A waiting call waits for the reconnection; fire-and-forget works again once it is up.
	if _, err := c.Ping(testwait.Within(t, 30*time.Second)); err != nil {
		t.Fatalf("ping after the restart: %v", err)
	}
	testwait.Eventually(t, "both connections back", func() bool { return c.Counters().Connects == 4 })
	if _, err := c.Prefetch(context.Background(), []string{path}, kvprefetch.PrefetchOptions{}); err != nil {
		t.Fatalf("fire-and-forget after the restart: %v", err)
	}
	testwait.Eventually(t, "the acknowledgement after the restart", func() bool { return c.Counters().Acked == 2 })
	if got := c.Counters(); got.Lost != 0 || got.ProtocolErrors != 0 || got.Sent != 2 {
		t.Fatalf("counters after the restart: %+v", got)
	}
}

func TestCloseEndsCalls(t *testing.T) {
	d := sharedDaemon(t)
	c := newClient(t, d.Socket, kvprefetch.Options{})
	if _, err := c.Ping(testwait.Within(t, 30*time.Second)); err != nil {
		t.Fatal(err)
	}
	c.Close()
	c.Close() // idempotent
	if _, err := c.Ping(testwait.Within(t, time.Second)); !errors.Is(err, kvprefetch.ErrClosed) {
		t.Fatalf("ping after Close: %v", err)
	}
	_, err := c.Prefetch(context.Background(), []string{"/x"}, kvprefetch.PrefetchOptions{})
	if !errors.Is(err, kvprefetch.ErrDropped) || !errors.Is(err, kvprefetch.ErrClosed) {
		t.Fatalf("fire-and-forget after Close: %v", err)
	}
}

func TestWaitNamesTheFilesNotWarmedAndWhy(t *testing.T) {
	d := sharedDaemon(t)
	c := newClient(t, d.Socket, kvprefetch.Options{})
	ctx := testwait.Within(t, 30*time.Second)
	good := d.MakeFile(t, "why/good.bin", 4096)
	absent := filepath.Join(d.Root, "why/absent.bin")
	done, err := c.Prefetch(ctx, []string{good, absent, "/etc/passwd"}, kvprefetch.PrefetchOptions{Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	want := map[kvprefetch.Failure]bool{
		{Path: absent, Outcome: kvprefetch.OutcomeMissing, Reason: "ENOENT"}:                true,
		{Path: "/etc/passwd", Outcome: kvprefetch.OutcomeRejected, Reason: "outside_roots"}: true,
	}
	if len(done.Failures) != 2 || !want[done.Failures[0]] || !want[done.Failures[1]] || done.FailuresTruncated != 0 {
		t.Fatalf("failures: %+v", done)
	}
	ack, err := c.Prefetch(ctx, []string{good}, kvprefetch.PrefetchOptions{Ack: true})
	if err != nil || ack.Room <= 0 || ack.Failures != nil {
		t.Fatalf("ack: %+v, %v", ack, err)
	}
}

func TestAPastDeadlineReadsNothingAndAContextDeadlineRidesAlong(t *testing.T) {
	d := sharedDaemon(t)
	c := newClient(t, d.Socket, kvprefetch.Options{})
	ctx := testwait.Within(t, 30*time.Second)
	var paths []string
	for i := 0; i < 8; i++ {
		paths = append(paths, d.MakeFile(t, fmt.Sprintf("late/%d.bin", i), 4096))
	}
	late, err := c.Prefetch(ctx, paths, kvprefetch.PrefetchOptions{Wait: true, Deadline: time.Now().Add(-time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	if late.Outcomes[kvprefetch.OutcomeExpired] != 8 || len(late.Failures) != 8 || late.Failures[0].Reason != "deadline" {
		t.Fatalf("past deadline: %+v", late)
	}
	// The context's deadline (a router's request) is minutes away: every file is read.
	onTime, err := c.Prefetch(ctx, paths, kvprefetch.PrefetchOptions{Wait: true})
	if err != nil || onTime.Outcomes[kvprefetch.OutcomeExpired] != 0 || onTime.Failures != nil {
		t.Fatalf("within the context's deadline: %+v, %v", onTime, err)
	}
}

// The daemon refuses a deadline or timeout beyond a day (docs/protocol.md, "Numeric
// fields"); the client sends a far context deadline, a year-old one or a week's Timeout
// within that range, and the request is served.
func TestFarDeadlinesAreSentWithinTheDaemonsRange(t *testing.T) {
	d := sharedDaemon(t)
	c := newClient(t, d.Socket, kvprefetch.Options{})
	path := d.MakeFile(t, "far/a.bin", 4096)
	far, cancel := context.WithDeadline(context.Background(), time.Now().Add(365*24*time.Hour))
	defer cancel()
	reply, err := c.Prefetch(far, []string{path}, kvprefetch.PrefetchOptions{Wait: true})
	if err != nil || reply.Failures != nil {
		t.Fatalf("a year's context deadline: %+v, %v", reply, err)
	}
	ctx := testwait.Within(t, 30*time.Second)
	reply, err = c.Prefetch(ctx, []string{path}, kvprefetch.PrefetchOptions{Wait: true, Timeout: 7 * 24 * time.Hour})
	if err != nil || reply.Failures != nil {
		t.Fatalf("a week's Timeout: %+v, %v", reply, err)
	}
	// A file of its own: the two above are remembered as warm, which no deadline changes.
	old := d.MakeFile(t, "far/b.bin", 4096)
	reply, err = c.Prefetch(ctx, []string{old}, kvprefetch.PrefetchOptions{Wait: true, Deadline: time.Now().Add(-365 * 24 * time.Hour)})
	if err != nil || reply.Outcomes[kvprefetch.OutcomeExpired] != 1 {
		t.Fatalf("a deadline a year past: %+v, %v", reply, err)
	}
}

func TestCheckAndEvict(t *testing.T) {
	d := daemontest.Start(t, daemontest.Config{Extra: "allow_evict = true\n"})
	c := newClient(t, d.Socket, kvprefetch.Options{})
	ctx := testwait.Within(t, 30*time.Second)
	a, b := d.MakeFile(t, "chk/a.bin", 64<<10), d.MakeFile(t, "chk/b.bin", 64<<10)
	syscall.Sync() // DONTNEED drops clean pages only
	if _, err := c.Evict(ctx, []string{a, b}, kvprefetch.CheckOptions{Whole: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Prefetch(ctx, []string{a}, kvprefetch.PrefetchOptions{Wait: true}); err != nil {
		t.Fatal(err)
	}
	res, err := c.Check(ctx, []string{a, b, filepath.Join(d.Root, "chk/none")}, kvprefetch.CheckOptions{Details: true})
	if err != nil {
		t.Fatal(err)
	}
	if res.Files != 3 || res.States["cold"] < 1 || res.States["missing"] != 1 || len(res.Results) != 3 {
		t.Fatalf("check: %+v", res)
	}
	byPath := map[string]kvprefetch.FileResult{}
	for _, r := range res.Results {
		byPath[r.Path] = r
	}
	if byPath[b].State != "cold" || byPath[b].Size != 64<<10 || byPath[b].ResidentBytes != 0 {
		t.Fatalf("b: %+v", byPath[b])
	}
	gone, err := c.Evict(ctx, []string{a}, kvprefetch.CheckOptions{Whole: true})
	if err != nil || gone.EvictedFiles != 1 || gone.ResidentBytes != 0 {
		t.Fatalf("evict: %+v, %v", gone, err)
	}
	if _, err := c.Check(ctx, []string{a}, kvprefetch.CheckOptions{Whole: true}); err == nil {
		t.Fatal("Check took Whole")
	}
}

func TestEvictIsRefusedByDefault(t *testing.T) {
	d := sharedDaemon(t)
	c := newClient(t, d.Socket, kvprefetch.Options{})
	ctx := testwait.Within(t, 30*time.Second)
	_, err := c.Evict(ctx, []string{d.MakeFile(t, "ev/a.bin", 4096)}, kvprefetch.CheckOptions{})
	var se *kvprefetch.ServerError
	if !errors.As(err, &se) || se.Code != kvprefetch.CodeForbidden {
		t.Fatalf("evict without allow_evict: %v", err)
	}
}
