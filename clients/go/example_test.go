package kvprefetch_test

import (
	"context"
	"fmt"

	kvprefetch "github.com/kvprefetchd/kvprefetchd/clients/go"
)

func ExampleClient_Prefetch() {
	kv, err := kvprefetch.New(kvprefetch.Options{SocketPath: "/run/kvprefetchd/kvprefetchd.sock"})
	if err != nil {
		panic(err) // only invalid options fail here; the daemon may come up later
	}
	defer kv.Close()

	// In the router's request path: send and move on. At most 1 ms by default.
	paths := []string{"/mnt/kv/Qwen_Qwen3-8B_07d7b166f256_r0/0a1/b2_g0/0a1b2c.bin"}
	if _, err := kv.Prefetch(context.Background(), paths, kvprefetch.PrefetchOptions{}); err != nil {
		// A *DroppedError: counted in kv.Counters().Dropped; a warm-up is only a hint.
		fmt.Println("prefetch dropped:", err)
	}
}
