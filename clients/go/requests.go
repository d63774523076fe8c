package kvprefetch

import (
	"bytes"
	"context"

	"github.com/vmihailenco/msgpack/v5"
)

// encodePrefetch builds a prefetch frame by hand: this is the call a router makes per
// request, so it avoids reflection (see mapWriter).
func encodePrefetch(id uint64, paths []string, o PrefetchOptions, timeoutMS *int64, d wireDeadline, maxFrame int) (*bytes.Buffer, error) {
	buf := newFrame()
	// One allocation of the right size when the pool is empty (it is emptied at every
	// GC), instead of doubling a fresh buffer a dozen times: each path costs its bytes
	// plus at most 5 of msgpack header.
	size := 96
	for _, p := range paths {
		size += len(p) + 5
	}
	buf.Grow(size)
	err := withEncoder(buf, func(enc *msgpack.Encoder) error {
		w := mapWriter{enc: enc}
		fields := 4
		if o.Wait {
			fields++
		}
		if o.ReadBytes > 0 {
			fields++
		}
		if timeoutMS != nil {
			fields++
		}
		if d.ms != nil || d.unixMS > 0 {
			fields++
		}
		if o.MaxFailures > 0 {
			fields++
		}
		w.mapLen(fields)
		w.envelope(id, opPrefetch)
		w.str("paths")
		w.arrayLen(len(paths))
		for _, p := range paths {
			w.path(p)
		}
		if o.Wait {
			w.str("wait")
			w.bool(true)
		}
		if o.ReadBytes > 0 {
			w.str("read_bytes")
			w.uint(uint64(o.ReadBytes))
		}
		if timeoutMS != nil {
			w.str("timeout_ms")
			w.uint(uint64(*timeoutMS))
		}
		if d.ms != nil {
			w.str("deadline_ms")
			w.uint(uint64(*d.ms))
		} else if d.unixMS > 0 {
			w.str("deadline_unix_ms")
			w.uint(uint64(d.unixMS))
		}
		if o.MaxFailures > 0 {
			w.str("max_failures")
			w.uint(uint64(o.MaxFailures))
		}
		return w.err
	})
	return finishFrame(buf, err, maxFrame)
}

// wireDeadline is a request's deadline as PrefetchOptions.deadline says to send it.
type wireDeadline struct {
	ms     *int64
	unixMS int64
}

func deadlineOf(o PrefetchOptions, ctx context.Context) wireDeadline {
	ms, unixMS := o.deadline(ctx)
	return wireDeadline{ms, unixMS}
}

// plainRequest is a request with no fields beyond the envelope (ping, stats).
type plainRequest struct {
	V  int    `msgpack:"v"`
	ID uint64 `msgpack:"id"`
	Op string `msgpack:"op"`
}

// kvRequest is resolve and prefetch_blocks: the envelope, the KV request's fields at the
// top level (as the protocol lays them out), and the warm options.
type kvRequest struct {
	V              int    `msgpack:"v"`
	ID             uint64 `msgpack:"id"`
	Op             string `msgpack:"op"`
	KVRequest      `msgpack:",inline"`
	Wait           bool   `msgpack:"wait,omitempty"`
	ReadBytes      int64  `msgpack:"read_bytes,omitempty"`
	TimeoutMS      *int64 `msgpack:"timeout_ms,omitempty"`
	DeadlineMS     *int64 `msgpack:"deadline_ms,omitempty"`
	DeadlineUnixMS int64  `msgpack:"deadline_unix_ms,omitempty"`
	MaxFailures    int    `msgpack:"max_failures,omitempty"`
}

// inspectRequest is check and evict.
type inspectRequest struct {
	V         int       `msgpack:"v"`
	ID        uint64    `msgpack:"id"`
	Op        string    `msgpack:"op"`
	Paths     wirePaths `msgpack:"paths"`
	ReadBytes int64     `msgpack:"read_bytes,omitempty"`
	Details   bool      `msgpack:"details,omitempty"`
	TimeoutMS *int64    `msgpack:"timeout_ms,omitempty"`
	Whole     bool      `msgpack:"whole,omitempty"`
}

// wirePaths encodes paths as the protocol wants them: str, or bin for a name that is not
// UTF-8 (mapWriter.path).
type wirePaths []string

// EncodeMsgpack implements msgpack.CustomEncoder.
func (p wirePaths) EncodeMsgpack(enc *msgpack.Encoder) error {
	w := mapWriter{enc: enc}
	w.arrayLen(len(p))
	for _, path := range p {
		w.path(path)
	}
	return w.err
}

func encodeValue(v any, maxFrame int) (*bytes.Buffer, error) {
	buf := newFrame()
	err := withEncoder(buf, func(enc *msgpack.Encoder) error { return enc.Encode(v) })
	return finishFrame(buf, err, maxFrame)
}

// EncodeMsgpack writes a prompt by hand (msgpack.CustomEncoder): its token ids are most of
// a KV request, and reflection would spend far more per token than the token's bytes.
// The map is the one the struct tags describe.
func (p Prompt) EncodeMsgpack(enc *msgpack.Encoder) error {
	fields := 1
	if p.CacheSalt != nil {
		fields++
	}
	if p.LoRA != nil {
		fields++
	}
	if len(p.MMFeatures) > 0 {
		fields++
	}
	w := mapWriter{enc: enc}
	w.mapLen(fields)
	w.str("token_ids")
	w.arrayLen(len(p.TokenIDs))
	for _, t := range p.TokenIDs {
		w.uint(uint64(t))
	}
	if p.CacheSalt != nil {
		w.str("cache_salt")
		w.str(*p.CacheSalt)
	}
	if p.LoRA != nil {
		w.str("lora")
		put(&w, (*msgpack.Encoder).Encode, any(p.LoRA))
	}
	if len(p.MMFeatures) > 0 {
		w.str("mm_features")
		put(&w, (*msgpack.Encoder).Encode, any(p.MMFeatures))
	}
	return w.err
}
