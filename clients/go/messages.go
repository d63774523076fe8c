package kvprefetch

import (
	"context"
	"errors"
	"time"
)

// PrefetchOptions say how Prefetch and PrefetchBlocks are sent and answered. The zero value
// is fire-and-forget with the daemon's default head size.
type PrefetchOptions struct {
	// Ack waits for the daemon's acknowledgement (accepted, dropped and rejected counts),
	// which comes as soon as the files are queued. Without Ack or Wait the call returns once
	// the request is handed to a connection, and the acknowledgement is only counted (see
	// Counters).
	Ack bool
	// Wait asks the daemon to answer once every accepted file has an outcome (implies Ack).
	Wait bool
	// ReadBytes is the head of each file to warm; 0 means the daemon's read_bytes.
	ReadBytes int64
	// Timeout bounds a Wait on the daemon's side (timeout_ms): files not done by then are
	// counted `expired`. When zero, it is derived from the context's deadline (or
	// Options.CallTimeout), so the daemon answers with what it has before the caller gives up.
	Timeout time.Duration
	// Deadline is when the request stops mattering (the GPU already ran it): a file whose
	// read has not been issued by then is skipped, settled `expired`, and takes no fetch
	// slot on a slow tier. When zero, the context's deadline is used if it has one. Sent
	// as deadline_ms, relative, so the hosts' clocks need not agree (one already past as
	// deadline_unix_ms: every file expires at once).
	Deadline time.Time
	// NoDeadline sends no deadline at all, overriding the context's and the daemon's
	// default_deadline_ms (deadline_ms: 0).
	NoDeadline bool
	// MaxFailures is how many files not warmed a reply lists (PrefetchResult.Failures);
	// 0 means the daemon's default (100), which its max_failures_listed caps.
	MaxFailures int
}

func (o PrefetchOptions) fireAndForget() bool { return !o.Ack && !o.Wait }

func (o PrefetchOptions) check() error {
	if o.ReadBytes < 0 {
		return errors.New("kvprefetch: ReadBytes must not be negative")
	}
	if o.Timeout < 0 {
		return errors.New("kvprefetch: Timeout must not be negative")
	}
	if o.MaxFailures < 0 {
		return errors.New("kvprefetch: MaxFailures must not be negative")
	}
	if o.NoDeadline && !o.Deadline.IsZero() {
		return errors.New("kvprefetch: Deadline and NoDeadline are exclusive")
	}
	if o.Timeout > 0 && !o.Wait {
		// The protocol gives timeout_ms meaning only with wait; sending it alone would be
		// silently ignored, hiding the caller's mistake.
		return errors.New("kvprefetch: Timeout applies only with Wait")
	}
	return nil
}

// timeoutMS is the timeout_ms to send: the caller's, else most of the time left before
// the call's deadline, keeping a tenth for the reply to travel back.
func (o PrefetchOptions) timeoutMS(ctx context.Context) *int64 {
	if !o.Wait {
		return nil
	}
	var ms int64
	if o.Timeout > 0 {
		ms = o.Timeout.Milliseconds()
	} else if deadline, ok := ctx.Deadline(); ok {
		ms = (time.Until(deadline) * 9 / 10).Milliseconds()
	} else {
		return nil
	}
	if ms < 0 {
		ms = 0
	}
	if ms > maxWindowMS {
		ms = maxWindowMS
	}
	return &ms
}

// maxWindowMS is the daemon's ceiling on timeout_ms and deadline_ms, and how far
// deadline_unix_ms may lie from its clock (docs/protocol.md, "Numeric fields"): a
// context deadline further away is sent as this, which means the same to a warm-up.
const maxWindowMS int64 = 24 * 60 * 60 * 1000

// deadline is what to send for the request's deadline: deadline_ms (ms >= 0: 0 for
// NoDeadline, else the time left before Deadline or the context's deadline, rounded up),
// or, for a deadline already past, which no relative figure can say, deadline_unix_ms
// (unixMS > 0). Neither when there is no deadline.
func (o PrefetchOptions) deadline(ctx context.Context) (ms *int64, unixMS int64) {
	var zero int64
	if o.NoDeadline {
		return &zero, 0
	}
	deadline := o.Deadline
	if deadline.IsZero() {
		var ok bool
		if deadline, ok = ctx.Deadline(); !ok {
			return nil, 0
		}
	}
	left := time.Until(deadline)
	if left <= 0 {
		// Past is past: a day ago says it as well as a year ago, and stays in the range.
		unixMS := deadline.UnixMilli()
		if oldest := time.Now().UnixMilli() - maxWindowMS/2; unixMS < oldest {
			unixMS = oldest
		}
		return nil, unixMS
	}
	rounded := int64((left + time.Millisecond - 1) / time.Millisecond)
	if rounded > maxWindowMS {
		rounded = maxWindowMS
	}
	return &rounded, 0
}

// KVRequest names how to hash and where the files live, then the prompts
// (docs/protocol.md, "KV requests"). Give Model (a profile in the daemon's configuration)
// or Hash and Layout inline; then Prompts, or BlockHashes already computed.
type KVRequest struct {
	Model       string     `msgpack:"model,omitempty"`
	Hash        *HashSpec  `msgpack:"hash,omitempty"`
	Layout      *Layout    `msgpack:"layout,omitempty"`
	Prompts     []Prompt   `msgpack:"prompts,omitempty"`
	BlockHashes [][][]byte `msgpack:"block_hashes,omitempty"` // per prompt, 32-byte hashes
}

// HashSpec is how vLLM hashes blocks. The field names are the daemon's profile keys.
type HashSpec struct {
	Algo string `msgpack:"algo"` // vLLM --prefix-caching-hash-algo: "sha256_cbor" or "sha256"
	// PythonHashSeed is vLLM's PYTHONHASHSEED; nil when it is unset.
	PythonHashSeed      *string `msgpack:"python_hash_seed,omitempty"`
	BlockSize           int     `msgpack:"block_size"`             // vLLM --block-size, tokens
	VLLMVersion         string  `msgpack:"vllm_version,omitempty"` // selects the extra-key era
	HashBlockSizeTokens int     `msgpack:"hash_block_size_tokens,omitempty"`
}

// Layout is where the fs connector writes the files. Zero sizes mean the daemon's default.
type Layout struct {
	RootDir                  string         `msgpack:"root_dir"`
	ModelName                string         `msgpack:"model_name"` // vLLM --model as given
	TPSize                   int            `msgpack:"tp_size,omitempty"`
	PPSize                   int            `msgpack:"pp_size,omitempty"`
	PCPSize                  int            `msgpack:"pcp_size,omitempty"`
	DCPSize                  int            `msgpack:"dcp_size,omitempty"`
	Dtype                    string         `msgpack:"dtype,omitempty"`
	KVCacheGroups            []KVCacheGroup `msgpack:"kv_cache_groups"`
	ConnectorBlockSizeTokens int            `msgpack:"connector_block_size_tokens,omitempty"`
	// Fingerprint is the 12-hex folder tag, or "discover" to let the daemon find it on disk.
	Fingerprint       string         `msgpack:"fingerprint,omitempty"`
	FingerprintFields map[string]any `msgpack:"fingerprint_fields,omitempty"`
}

// KVCacheGroup is one of the model's KV-cache groups.
type KVCacheGroup struct {
	BlockSize  int      `msgpack:"block_size"`
	LayerNames []string `msgpack:"layer_names,omitempty"`
}

// Prompt is one prompt's tokens and what vLLM mixes into its block hashes.
type Prompt struct {
	TokenIDs   []uint32    `msgpack:"token_ids"`
	CacheSalt  *string     `msgpack:"cache_salt,omitempty"`
	LoRA       *LoRA       `msgpack:"lora,omitempty"`
	MMFeatures []MMFeature `msgpack:"mm_features,omitempty"`
}

// LoRA names the adapter a prompt runs with.
type LoRA struct {
	Name string `msgpack:"name"`
	Path string `msgpack:"path,omitempty"`
}

// MMFeature is one multimodal item's placeholder range and vLLM's hash of it.
type MMFeature struct {
	Identifier string `msgpack:"identifier"`
	Offset     int    `msgpack:"offset"`
	Length     int    `msgpack:"length"`
}

// BlocksRequest is a PrefetchBlocks call: the KV request and how to send it.
type BlocksRequest struct {
	KVRequest
	PrefetchOptions
}

// PingResult is the daemon's answer to Ping.
type PingResult struct {
	Version  string // daemon version
	Protocol int    // protocol version it speaks
	Engine   string // io_uring, fadvise or pread
	Workers  int
}

// PrefetchResult is the daemon's answer to an acknowledged or waited prefetch.
type PrefetchResult struct {
	Accepted int // queued to a worker
	Dropped  int // found their worker's queue full: counted, never waited for
	Rejected int // refused before any I/O (outside the roots, relative, ...)
	// Outcomes (Wait only) counts the accepted files by outcome; every name is present.
	Outcomes map[string]int
	Elapsed  time.Duration // Wait only
	Files    int           // PrefetchBlocks only: the paths the request mapped to
	// Failures lists files that were not warmed, and why: an Ack those turned away at
	// once (rejected, dropped), a Wait every one, at most MaxFailures; FailuresTruncated
	// counts the rest. A daemon before 0.3 sends neither.
	Failures          []Failure
	FailuresTruncated int
	// Room (Ack only) is how many more files the daemon's queues take now; -1 when the
	// reply did not say. A bulk sender keeps its batches within it.
	Room int
}

// Failure is a file that was not warmed (docs/protocol.md, "Failures").
type Failure struct {
	Path    string // the caller's spelling, or the canonical path under its root
	Outcome string // missing, rejected, failed, expired or dropped
	Reason  string // e.g. ENOENT, outside_roots, symlink_escape, deadline, dropped_queue_full
}

// CheckOptions say how Check and Evict look at files.
type CheckOptions struct {
	// ReadBytes is the head the residency rule judges (and Evict drops); 0 means the
	// daemon's read_bytes.
	ReadBytes int64
	// Details asks for each file's figures (CheckResult.Results).
	Details bool
	// Timeout bounds the daemon's side (timeout_ms); files not looked at by then are
	// counted `expired`.
	Timeout time.Duration
	// Whole (Evict only) drops whole files, not only their heads.
	Whole bool
}

// CheckResult is what Check found, or what Evict left (docs/protocol.md, "Check states").
type CheckResult struct {
	Files         int
	ResidentFiles int   // head resident by the root's rule
	SizeBytes     int64 // of every file looked at
	ResidentBytes int64 // page-cache bytes of the whole files
	States        map[string]int
	Elapsed       time.Duration
	EvictedFiles  int          // Evict only
	Results       []FileResult // with Details
}

// FileResult is one file of a Check or Evict with Details.
type FileResult struct {
	Path          string
	State         string // resident, cold, missing, rejected, failed, dropped
	Size          int64
	ResidentBytes int64
	TierBytes     int64  // allocated on the near tier (st_blocks x 512)
	Reason        string // why a file could not be looked at
}

// Resolution is what a KV request maps to, without any I/O.
type Resolution struct {
	BlockHashes [][]string // lower-case hex, one chain per prompt
	Paths       []string   // rank, then group, then file order
	Fingerprint string     // the folder tag the daemon used
}
