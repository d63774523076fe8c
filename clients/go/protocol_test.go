package kvprefetch

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/vmihailenco/msgpack/v5"
)

// decodeFrame checks a frame's header and returns its map.
func decodeFrame(t *testing.T, frame []byte) map[string]any {
	t.Helper()
	if len(frame) < headerSize || int(binary.BigEndian.Uint32(frame)) != len(frame)-headerSize {
		t.Fatalf("bad frame header: % x", frame[:minInt(len(frame), 8)])
	}
	var m map[string]any
	if err := msgpack.Unmarshal(frame[headerSize:], &m); err != nil {
		t.Fatal(err)
	}
	return m
}

func minInt(a, b int) int {
	if a < b {
		return a
	}
	return b
}

func TestPingFrameIsExactlyTheProtocolsBytes(t *testing.T) {
	buf, err := encodeValue(&plainRequest{V: ProtocolVersion, ID: 1, Op: opPing}, DefaultMaxFrameBytes)
	if err != nil {
		t.Fatal(err)
	}
	// 4-byte big-endian length, then {"v": 1, "id": 1, "op": "ping"} with compact ints.
	want := []byte{0, 0, 0, 16, 0x83, 0xa1, 'v', 0x01, 0xa2, 'i', 'd', 0x01, 0xa2, 'o', 'p', 0xa4, 'p', 'i', 'n', 'g'}
	if !bytes.Equal(buf.Bytes(), want) {
		t.Fatalf("ping frame\n got % x\nwant % x", buf.Bytes(), want)
	}
}

func TestPrefetchFrameFields(t *testing.T) {
	cases := []struct {
		name    string
		opts    PrefetchOptions
		timeout *int64
		want    []string // fields beyond v, id, op and paths
	}{
		{"fire and forget", PrefetchOptions{}, nil, nil},
		{"ack", PrefetchOptions{Ack: true, ReadBytes: 4096}, nil, []string{"read_bytes"}},
		{"wait", PrefetchOptions{Wait: true}, ptr(int64(250)), []string{"wait", "timeout_ms"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			buf, err := encodePrefetch(7, []string{"/a", "/b"}, tc.opts, tc.timeout, wireDeadline{}, DefaultMaxFrameBytes)
			if err != nil {
				t.Fatal(err)
			}
			m := decodeFrame(t, buf.Bytes())
			if m["op"] != "prefetch" || toInt(m["v"]) != 1 || toInt(m["id"]) != 7 {
				t.Fatalf("envelope: %v", m)
			}
			if paths, _ := m["paths"].([]any); len(paths) != 2 || paths[0] != "/a" {
				t.Fatalf("paths: %v", m["paths"])
			}
			if len(m) != 4+len(tc.want) {
				t.Fatalf("fields: %v, want the envelope, paths and %v", m, tc.want)
			}
			for _, k := range tc.want {
				if _, ok := m[k]; !ok {
					t.Fatalf("missing %q in %v", k, m)
				}
			}
			if tc.opts.ReadBytes > 0 && toInt(m["read_bytes"]) != 4096 {
				t.Fatalf("read_bytes: %v", m["read_bytes"])
			}
			if tc.timeout != nil && toInt(m["timeout_ms"]) != 250 {
				t.Fatalf("timeout_ms: %v", m["timeout_ms"])
			}
		})
	}
}

func ptr[T any](v T) *T { return &v }

// toInt reads an integer of decodeFrame's map, whatever width msgpack gave it; -1 for
// anything else.
func toInt(v any) int64 {
	switch n := reflect.ValueOf(v); {
	case n.CanInt():
		return n.Int()
	case n.CanUint():
		return int64(n.Uint())
	}
	return -1
}

func TestNonUTF8PathIsEncodedAsBin(t *testing.T) {
	buf, err := encodePrefetch(1, []string{"/kv/caf\xe9", "/kv/café"}, PrefetchOptions{}, nil, wireDeadline{}, DefaultMaxFrameBytes)
	if err != nil {
		t.Fatal(err)
	}
	paths := decodeFrame(t, buf.Bytes())["paths"].([]any)
	if b, ok := paths[0].([]byte); !ok || string(b) != "/kv/caf\xe9" {
		t.Fatalf("non-UTF-8 path: %#v, want bin", paths[0])
	}
	if s, ok := paths[1].(string); !ok || s != "/kv/café" {
		t.Fatalf("UTF-8 path: %#v, want str", paths[1])
	}
}

func TestKVRequestLaysItsFieldsAtTheTopLevel(t *testing.T) {
	seed := "0"
	wire := kvRequest{V: 1, ID: 3, Op: opPrefetchBlocks, Wait: true, KVRequest: KVRequest{
		Hash:   &HashSpec{Algo: "sha256_cbor", PythonHashSeed: &seed, BlockSize: 16},
		Layout: &Layout{RootDir: "/kv", ModelName: "m", KVCacheGroups: []KVCacheGroup{{BlockSize: 16}}},
		Prompts: []Prompt{{TokenIDs: []uint32{1, 2, 70000}}, {
			TokenIDs: []uint32{}, CacheSalt: &seed, LoRA: &LoRA{Name: "adapter"},
			MMFeatures: []MMFeature{{Identifier: "img", Offset: 0, Length: 16}},
		}},
	}}
	buf, err := encodeValue(&wire, DefaultMaxFrameBytes)
	if err != nil {
		t.Fatal(err)
	}
	m := decodeFrame(t, buf.Bytes())
	for _, k := range []string{"v", "id", "op", "hash", "layout", "prompts", "wait"} {
		if _, ok := m[k]; !ok {
			t.Fatalf("missing %q in %v", k, m)
		}
	}
	for _, k := range []string{"model", "block_hashes", "read_bytes", "timeout_ms", "KVRequest"} {
		if _, ok := m[k]; ok {
			t.Fatalf("unexpected %q in %v", k, m)
		}
	}
	hash := m["hash"].(map[string]any)
	if hash["python_hash_seed"] != "0" || hash["algo"] != "sha256_cbor" {
		t.Fatalf("hash: %v", hash)
	}
	if _, ok := hash["vllm_version"]; ok {
		t.Fatalf("an empty vllm_version must be left out: %v", hash)
	}
	prompts := m["prompts"].([]any)
	first, second := prompts[0].(map[string]any), prompts[1].(map[string]any)
	if tokens := first["token_ids"].([]any); len(first) != 1 || toInt(tokens[2]) != 70000 {
		t.Fatalf("first prompt: %v", first)
	}
	lora, _ := second["lora"].(map[string]any)
	mm, _ := second["mm_features"].([]any)
	if len(second) != 4 || second["cache_salt"] != "0" || lora["name"] != "adapter" || len(lora) != 1 || len(mm) != 1 ||
		mm[0].(map[string]any)["identifier"] != "img" || len(second["token_ids"].([]any)) != 0 {
		t.Fatalf("second prompt: %v", second)
	}
}

func TestOversizeRequestsAreRefusedLocally(t *testing.T) {
	_, err := encodePrefetch(1, []string{strings.Repeat("/p", 100)}, PrefetchOptions{}, nil, wireDeadline{}, 64)
	if !errors.Is(err, ErrTooLarge) {
		t.Fatalf("want ErrTooLarge, got %v", err)
	}
}

func TestPrefetchOptionsChecks(t *testing.T) {
	for _, o := range []PrefetchOptions{{ReadBytes: -1}, {Timeout: time.Second}, {Wait: true, Timeout: -1}} {
		if o.check() == nil {
			t.Errorf("%+v passed the checks", o)
		}
	}
	if (PrefetchOptions{Wait: true, Timeout: time.Second}).check() != nil {
		t.Error("Wait with a Timeout refused")
	}
}

func TestWaitTimeoutComesFromTheDeadline(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if ms := (PrefetchOptions{Wait: true}).timeoutMS(ctx); ms == nil || *ms < 8000 || *ms > 9000 {
		t.Fatalf("timeout_ms from a 10 s deadline: %v", ms)
	}
	if ms := (PrefetchOptions{Wait: true, Timeout: 1500 * time.Millisecond}).timeoutMS(ctx); ms == nil || *ms != 1500 {
		t.Fatalf("an explicit Timeout wins: %v", ms)
	}
	if ms := (PrefetchOptions{Ack: true}).timeoutMS(ctx); ms != nil {
		t.Fatalf("no timeout_ms without Wait: %v", *ms)
	}
	if ms := (PrefetchOptions{Wait: true}).timeoutMS(context.Background()); ms != nil {
		t.Fatalf("no deadline, no Timeout: %v", *ms)
	}
}

func TestReplyDecoding(t *testing.T) {
	src := bytes.NewReader(nil)
	dec := msgpack.NewDecoder(src)
	encode := func(v any) []byte {
		b, err := msgpack.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}

	r, err := decodeReply(dec, src, encode(map[string]any{
		"id": 5, "ok": true, "accepted": 2, "dropped": 0, "rejected": 1, "elapsed_us": 1500,
		"outcomes": map[string]any{"read": 1, "missing": 1}, "newer_figure": []int{1},
	}))
	if err != nil {
		t.Fatal(err)
	}
	res, err := r.prefetch()
	if err != nil || res.Accepted != 2 || res.Rejected != 1 || res.Elapsed != 1500*time.Microsecond || res.Outcomes["missing"] != 1 {
		t.Fatalf("prefetch reply: %+v, %v", res, err)
	}

	r, err = decodeReply(dec, src, encode(map[string]any{"id": 5, "ok": true, "dropped": 0, "rejected": 0}))
	if err != nil {
		t.Fatal(err)
	}
	var pe *ProtocolError
	if _, err := r.prefetch(); !errors.As(err, &pe) || !strings.Contains(err.Error(), "accepted") {
		t.Fatalf("a reply without accepted: %v", err)
	}

	r, err = decodeReply(dec, src, encode(map[string]any{"id": nil, "ok": false, "error": map[string]any{"code": "too_large", "message": "m"}}))
	if err != nil || r.ID != nil {
		t.Fatalf("id-less error: %+v, %v", r, err)
	}
	var se *ServerError
	if err := r.check(); !errors.As(err, &se) || se.Code != CodeTooLarge {
		t.Fatalf("check: %v", err)
	}

	if _, err := decodeReply(dec, src, append(encode(map[string]any{"id": 1, "ok": true}), 0xc0)); !errors.As(err, &pe) {
		t.Fatalf("trailing bytes: %v", err)
	}
	if _, err := decodeReply(dec, src, encode([]int{1, 2})); !errors.As(err, &pe) {
		t.Fatalf("an array, not a map: %v", err)
	}

	r, err = decodeReply(dec, src, encode(map[string]any{"id": 1, "ok": true, "stats": map[any]any{"files": map[string]any{"read": 3, "big": uint64(1 << 40), "huge": uint64(1 << 63)}, 7: "seven", "list": []any{uint16(300)}}}))
	if err != nil {
		t.Fatal(err)
	}
	stats, err := r.stats()
	if err != nil {
		t.Fatal(err)
	}
	files := stats["files"].(map[string]any)
	if stats["7"] != "seven" || files["read"] != int64(3) || files["big"] != int64(1<<40) || files["huge"] != uint64(1<<63) || stats["list"].([]any)[0] != int64(300) {
		t.Fatalf("stats: %#v", stats)
	}
}

func TestDefaultSocketChain(t *testing.T) {
	t.Setenv("KVPREFETCHD_SOCKET", "/explicit.sock")
	if got := DefaultSocket(); got != "/explicit.sock" {
		t.Fatalf("explicit: %s", got)
	}
	t.Setenv("KVPREFETCHD_SOCKET", "")
	if _, err := os.Stat(SystemdSocket); err == nil {
		t.Skip("a systemd-managed daemon is installed here")
	}
	t.Setenv("RUNTIME_DIRECTORY", "/run/a:/run/b")
	if got := DefaultSocket(); got != "/run/a/kvprefetchd.sock" {
		t.Fatalf("RUNTIME_DIRECTORY: %s", got)
	}
	t.Setenv("RUNTIME_DIRECTORY", "")
	t.Setenv("XDG_RUNTIME_DIR", "")
	if got := DefaultSocket(); got != "/tmp/kvprefetchd.sock" {
		t.Fatalf("fallback: %s", got)
	}
}

// BenchmarkEncodePrefetch1000 is the CPU part of a fire-and-forget Prefetch of 1,000
// fs-connector-shaped paths: the frame, without any I/O.
func BenchmarkEncodePrefetch1000(b *testing.B) {
	paths := make([]string, 1000)
	for i := range paths {
		h := fmt.Sprintf("%064x", i*7919)
		paths[i] = "/mnt/kv/Qwen_Qwen3-8B_07d7b166f256_r0/" + h[:3] + "/" + h[3:5] + "_g0/" + h + ".bin"
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		buf, err := encodePrefetch(uint64(i), paths, PrefetchOptions{}, nil, wireDeadline{}, DefaultMaxFrameBytes)
		if err != nil {
			b.Fatal(err)
		}
		b.SetBytes(int64(buf.Len()))
		recycleFrame(buf)
	}
}

// BenchmarkEncodePrefetchBlocks4096 is the CPU part of a fire-and-forget PrefetchBlocks of
// one 4,096-token prompt with an inline profile.
func BenchmarkEncodePrefetchBlocks4096(b *testing.B) {
	seed := "0"
	tokens := make([]uint32, 4096)
	for i := range tokens {
		tokens[i] = uint32(i * 37 % 150000)
	}
	wire := kvRequest{V: 1, Op: opPrefetchBlocks, KVRequest: KVRequest{
		Hash:    &HashSpec{Algo: "sha256_cbor", PythonHashSeed: &seed, BlockSize: 64, VLLMVersion: "0.23.0"},
		Layout:  &Layout{RootDir: "/mnt/kv", ModelName: "Qwen/Qwen3-8B", Fingerprint: "07d7b166f256", KVCacheGroups: []KVCacheGroup{{BlockSize: 64}}, ConnectorBlockSizeTokens: 512},
		Prompts: []Prompt{{TokenIDs: tokens}},
	}}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		wire.ID = uint64(i)
		buf, err := encodeValue(&wire, DefaultMaxFrameBytes)
		if err != nil {
			b.Fatal(err)
		}
		b.SetBytes(int64(buf.Len()))
		recycleFrame(buf)
	}
}
