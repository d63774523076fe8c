package main

import (
	"context"
	"errors"
	"fmt"
	"time"

	kvprefetch "github.com/kvprefetchd/kvprefetchd/clients/go"
)

// Config is the seed plugin's JSON parameters (llm-d-router PR #1156, plugin type
// prefetch-prerequest-handler; field names as its PluginFactory reads them, see
// docs/kv-file-layout.md §6.1), plus what it took from elsewhere or lacked: the producer's
// hash settings, and where the daemon is.
type Config struct {
	// EngineKeysProviderPluginName named the precise-prefix-cache-producer that turned
	// prompts into digests. The daemon hashes token ids itself, so it is not needed; a
	// router that has the producer's 32-byte sha256_cbor digests anyway may send them as
	// KVRequest.BlockHashes instead (see PreRequestDigests).
	EngineKeysProviderPluginName string          `json:"engineKeysProviderPluginName"`
	KVFilePathBase               *KVFilePathBase `json:"kvFilePathBase"`
	PrefetchConfig               *PrefetchConfig `json:"prefetchConfig"`
	// TokenProcessorConfig lived on the producer plugin in the seed.
	TokenProcessorConfig TokenProcessorConfig `json:"tokenProcessorConfig"`
	// KVPrefetchd is new: the daemon and what the seed could not know.
	KVPrefetchd DaemonConfig `json:"kvprefetchd"`
}

// KVFilePathBase is where the fs connector writes, as the seed plugin described it.
type KVFilePathBase struct {
	RootDir           string `json:"rootDir"`
	ModelName         string `json:"modelName"`
	Digest            string `json:"digest"` // the 12-hex folder fingerprint
	KVCacheGroupCount int    `json:"kvCacheGroupCount"`
	GPUBlocksPerFile  int    `json:"gpuBlocksPerFile"`
	TPSize            int    `json:"tpSize"`
	PPSize            int    `json:"ppSize"`
	PCPSize           int    `json:"pcpSize"`
	DCPSize           int    `json:"dcpSize"`
}

// PrefetchConfig is the seed plugin's worker pool.
type PrefetchConfig struct {
	Enabled            bool `json:"enabled"`
	BlockSize          int  `json:"blockSize"`
	BlockCount         int  `json:"blockCount"`
	MaxConcurrentFiles int  `json:"maxConcurrentFiles"`
	WorkQueueSize      int  `json:"workQueueSize"`
}

// TokenProcessorConfig is the producer's hash settings (spec §6.6).
type TokenProcessorConfig struct {
	HashAlgorithm   string `json:"hashAlgorithm"`
	HashSeed        string `json:"hashSeed"`
	BlockSizeTokens int    `json:"blockSizeTokens"`
}

// DaemonConfig is what talking to kvprefetchd adds.
type DaemonConfig struct {
	Socket string `json:"socket"` // empty: kvprefetch.DefaultSocket()
	// SendTimeout bounds each PreRequest (Options.FireAndForgetTimeout), e.g. "1ms".
	SendTimeout string `json:"sendTimeout"`
	// VLLMVersion selects how vLLM mixes extra keys into hashes; the seed assumed one era.
	VLLMVersion string `json:"vllmVersion"`
	// Model, when set, names a profile in the daemon's config to use instead of sending
	// the hash and layout below with every request.
	Model string `json:"model"`
	// Deadline, e.g. "2s", is how long after PreRequest a file is still worth warming
	// when the request's context has no deadline of its own (which wins when it has):
	// past it the GPU has read the file itself, so the daemon skips files still queued
	// behind a slow tier (`expired`) and they take no fetch slot. Empty: the context's
	// deadline only.
	Deadline string `json:"deadline"`
	// NodeDaemons, when set, reaches the GPU nodes' daemons too (PreRequestTo).
	NodeDaemons NodeDaemons `json:"nodeDaemons"`
}

// The seed's defaults (spec §6.1): applied only to objects that are present.
const (
	seedBlockSize          = 4 << 20
	seedBlockCount         = 3
	seedMaxConcurrentFiles = 16
	seedWorkQueueSize      = 256
)

// applySeedDefaults does what the seed's PluginFactory did: counts below 1 become 1, zero
// sizes become the defaults. It returns whether prefetching is on (prefetchConfig present
// and enabled) and whether the path base is set (rootDir, modelName and digest all given).
func (c *Config) applySeedDefaults() (enabled, pathBaseSet bool) {
	if b := c.KVFilePathBase; b != nil {
		for _, n := range []*int{&b.KVCacheGroupCount, &b.GPUBlocksPerFile, &b.TPSize, &b.PPSize, &b.PCPSize, &b.DCPSize} {
			if *n < 1 {
				*n = 1
			}
		}
		pathBaseSet = b.RootDir != "" && b.ModelName != "" && b.Digest != ""
	}
	if p := c.PrefetchConfig; p != nil {
		for _, d := range []struct {
			v   *int
			def int
		}{{&p.BlockSize, seedBlockSize}, {&p.BlockCount, seedBlockCount}, {&p.MaxConcurrentFiles, seedMaxConcurrentFiles}, {&p.WorkQueueSize, seedWorkQueueSize}} {
			if *d.v <= 0 {
				*d.v = d.def
			}
		}
		enabled = p.Enabled
	}
	return enabled, pathBaseSet
}

// Plugin is the seed plugin's PreRequest handler rebuilt on the client: no worker pool,
// no queue, no reads in the router; one message to the daemon per request.
type Plugin struct {
	kv       *kvprefetch.Client
	template kvprefetch.KVRequest // hash and layout (or model); prompts filled per request
	opts     kvprefetch.PrefetchOptions
	deadline time.Duration // DaemonConfig.Deadline; 0: the context's only
	nodes    *nodes        // the GPU nodes' daemons; nil: the gateway's only
}

// NewPlugin maps the seed's configuration onto the client (README.md, "Example"). It
// returns a nil Plugin when prefetching is off, as the seed started no pool then.
func NewPlugin(cfg Config) (*Plugin, error) {
	enabled, pathBaseSet := cfg.applySeedDefaults()
	if !enabled {
		return nil, nil
	}
	template := kvprefetch.KVRequest{Model: cfg.KVPrefetchd.Model}
	if template.Model == "" {
		if !pathBaseSet {
			return nil, errors.New("kvFilePathBase: rootDir, modelName and digest are all required (or kvprefetchd.model)")
		}
		tp := cfg.TokenProcessorConfig
		if tp.BlockSizeTokens < 1 {
			return nil, errors.New("tokenProcessorConfig.blockSizeTokens: the vLLM block size is required")
		}
		algo := tp.HashAlgorithm
		if algo == "" {
			algo = "sha256_cbor"
		}
		seed := tp.HashSeed // as given: the producer hashed it as given too
		template.Hash = &kvprefetch.HashSpec{
			Algo: algo, PythonHashSeed: &seed, BlockSize: tp.BlockSizeTokens, VLLMVersion: cfg.KVPrefetchd.VLLMVersion,
		}
		template.Layout = layoutFromSeed(cfg.KVFilePathBase, tp.BlockSizeTokens)
	}
	opts := kvprefetch.Options{SocketPath: cfg.KVPrefetchd.Socket}
	if s := cfg.KVPrefetchd.SendTimeout; s != "" {
		d, err := time.ParseDuration(s)
		if err != nil {
			return nil, fmt.Errorf("kvprefetchd.sendTimeout: %w", err)
		}
		opts.FireAndForgetTimeout = d
	}
	var deadline time.Duration
	if s := cfg.KVPrefetchd.Deadline; s != "" {
		d, err := time.ParseDuration(s)
		if err != nil || d <= 0 {
			return nil, fmt.Errorf("kvprefetchd.deadline: %q is not a positive duration", s)
		}
		deadline = d
	}
	// maxConcurrentFiles and workQueueSize have no client counterpart: the reads and
	// their queue are the daemon's (workers, pread_threads, queue_limit), and a full queue
	// drops and counts there, as the seed's full channel skipped.
	nodeDaemons, err := newNodes(cfg.KVPrefetchd.NodeDaemons, opts.FireAndForgetTimeout)
	if err != nil {
		return nil, err
	}
	kv, err := kvprefetch.New(opts)
	if err != nil {
		return nil, err
	}
	p := cfg.PrefetchConfig
	return &Plugin{
		kv:       kv,
		template: template,
		opts:     kvprefetch.PrefetchOptions{ReadBytes: int64(p.BlockSize) * int64(p.BlockCount)},
		deadline: deadline,
		nodes:    nodeDaemons,
	}, nil
}

// layoutFromSeed is the seed's path base as a daemon layout, without the seed's gaps
// (spec §6.5): the daemon enumerates tp·pp·pcp ranks (not ×dcp) and takes the connector
// file size in tokens, which is gpuBlocksPerFile hash blocks of blockSize·dcp·pcp tokens.
// It matches the daemon's own kvprefetchd.kv.profile.layout_from_pr1156.
func layoutFromSeed(b *KVFilePathBase, blockSizeTokens int) *kvprefetch.Layout {
	groups := make([]kvprefetch.KVCacheGroup, b.KVCacheGroupCount)
	for i := range groups {
		groups[i] = kvprefetch.KVCacheGroup{BlockSize: blockSizeTokens}
	}
	return &kvprefetch.Layout{
		RootDir:                  b.RootDir,
		ModelName:                b.ModelName,
		Fingerprint:              b.Digest,
		TPSize:                   b.TPSize,
		PPSize:                   b.PPSize,
		PCPSize:                  b.PCPSize,
		DCPSize:                  b.DCPSize,
		KVCacheGroups:            groups,
		ConnectorBlockSizeTokens: b.GPUBlocksPerFile * blockSizeTokens * b.DCPSize * b.PCPSize,
	}
}

// PreRequest is the hook the router calls after its routing decision: build the request,
// send it, never wait. An error means the request was dropped (daemon down, every slot
// busy); it is counted in Counters and there is nothing to do about it in the request path.
// The request context's deadline (else kvprefetchd.deadline from now) travels with it:
// files the daemon has not started by then are skipped.
func (p *Plugin) PreRequest(ctx context.Context, prompts [][]uint32) error {
	if p == nil {
		return nil // prefetching is off
	}
	req := kvprefetch.BlocksRequest{KVRequest: p.template, PrefetchOptions: p.options(ctx)}
	req.Prompts = make([]kvprefetch.Prompt, len(prompts))
	for i, tokens := range prompts {
		req.Prompts[i] = kvprefetch.Prompt{TokenIDs: tokens}
	}
	_, err := p.kv.PrefetchBlocks(ctx, req)
	return err
}

// options are the request's: the configured ones, with the default deadline when ctx has
// none (the client sends ctx's own).
func (p *Plugin) options(ctx context.Context) kvprefetch.PrefetchOptions {
	opts := p.opts
	if _, ok := ctx.Deadline(); !ok && p.deadline > 0 {
		opts.Deadline = time.Now().Add(p.deadline)
	}
	return opts
}

// PreRequestDigests is PreRequest for a router that already has the producer's 32-byte
// sha256_cbor digests, one chain per prompt: the daemon skips the hashing.
func (p *Plugin) PreRequestDigests(ctx context.Context, digests [][][]byte) error {
	if p == nil {
		return nil
	}
	req := kvprefetch.BlocksRequest{KVRequest: p.template, PrefetchOptions: p.options(ctx)}
	req.BlockHashes = digests
	_, err := p.kv.PrefetchBlocks(ctx, req)
	return err
}

// Counters is what the router may export as metrics (the seed had logs only; its
// "skipped" is Dropped here, and the daemon's own drops are FilesDropped).
func (p *Plugin) Counters() kvprefetch.Counters {
	if p == nil {
		return kvprefetch.Counters{}
	}
	return p.kv.Counters()
}

// Close ends the plugin's connections (the seed had no shutdown hook).
func (p *Plugin) Close() error {
	if p == nil {
		return nil
	}
	if p.nodes != nil {
		p.nodes.close()
	}
	return p.kv.Close()
}
