// Command prerequest shows how an llm-d router plugin calls kvprefetchd: the seed
// "KV-cache file prefetch plugin" (llm-d-router PR #1156) with its configuration mapped
// onto the Go client (plugin.go), and a PreRequest that sends and never waits.
//
// It plays a router: it reads the plugin's JSON parameters, makes random prompts, calls
// PreRequest for each, and prints what each call cost the request path and what became of
// the requests.
//
//	go run ./examples/prerequest -config params.json -requests 100
//
// Without -config it uses the seed's README example with rootDir /tmp/shared-kv, the root
// a kvprefetchd started with no configuration allows.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"math/rand"
	"os"
	"sort"
	"time"
)

// exampleParams are the seed plugin's parameters (its README's live example: Qwen3-8B,
// 64-token blocks, 8 blocks per file, fingerprint 07d7b166f256) and the additions.
const exampleParams = `{
  "engineKeysProviderPluginName": "precise-prefix-cache-producer",
  "kvFilePathBase": {"rootDir": "/tmp/shared-kv", "modelName": "Qwen/Qwen3-8B", "digest": "07d7b166f256",
                     "kvCacheGroupCount": 1, "gpuBlocksPerFile": 8, "tpSize": 1},
  "prefetchConfig": {"enabled": true, "blockSize": 4194304, "blockCount": 3,
                     "maxConcurrentFiles": 16, "workQueueSize": 256},
  "tokenProcessorConfig": {"hashAlgorithm": "sha256_cbor", "hashSeed": "0", "blockSizeTokens": 64},
  "kvprefetchd": {"sendTimeout": "1ms", "vllmVersion": "0.23.0"}
}`

func main() {
	configPath := flag.String("config", "", "plugin parameters (JSON); default: the seed README's example")
	socket := flag.String("socket", "", "daemon socket (overrides kvprefetchd.socket)")
	requests := flag.Int("requests", 100, "requests to play")
	tokens := flag.Int("tokens", 4096, "tokens per prompt")
	flag.Parse()

	raw := []byte(exampleParams)
	if *configPath != "" {
		var err error
		if raw, err = os.ReadFile(*configPath); err != nil {
			log.Fatal(err)
		}
	}
	var cfg Config
	if err := json.Unmarshal(raw, &cfg); err != nil {
		log.Fatalf("plugin parameters: %v", err)
	}
	if *socket != "" {
		cfg.KVPrefetchd.Socket = *socket
	}
	plugin, err := NewPlugin(cfg)
	if err != nil {
		log.Fatal(err)
	}
	if plugin == nil {
		log.Print("prefetchConfig.enabled is false: the plugin does nothing")
		return
	}
	defer plugin.Close()
	// The client connects in the background; a router would not wait, but a demo wants
	// its first requests to count.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	if _, err := plugin.kv.Ping(ctx); err != nil {
		log.Printf("no daemon yet (%v): the requests will be dropped and counted", err)
	}
	cancel()

	rng := rand.New(rand.NewSource(1))
	took := make([]time.Duration, 0, *requests)
	for i := 0; i < *requests; i++ {
		prompt := make([]uint32, *tokens)
		for j := range prompt {
			prompt[j] = uint32(rng.Intn(150_000))
		}
		start := time.Now()
		err := plugin.PreRequest(context.Background(), [][]uint32{prompt})
		took = append(took, time.Since(start))
		if err != nil {
			log.Printf("request %d: %v", i, err) // a router would log this at a debug level
		}
		time.Sleep(5 * time.Millisecond)
	}
	time.Sleep(200 * time.Millisecond) // let the last acknowledgements in
	sort.Slice(took, func(i, j int) bool { return took[i] < took[j] })
	fmt.Printf("PreRequest: p50 %v, p99 %v, max %v\n", took[len(took)/2], took[len(took)*99/100], took[len(took)-1])
	c := plugin.Counters()
	fmt.Printf("requests: sent %d, acknowledged %d, refused %d, dropped %d, lost %d\n", c.Sent, c.Acked, c.Refused, c.Dropped, c.Lost)
	fmt.Printf("files: accepted %d, dropped by the daemon %d, rejected %d\n", c.FilesAccepted, c.FilesDropped, c.FilesRejected)
}
