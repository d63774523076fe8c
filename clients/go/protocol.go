package kvprefetch

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"sync"
	"unicode/utf8"

	"github.com/vmihailenco/msgpack/v5"
)

// ProtocolVersion is the version of the wire protocol this client speaks
// (docs/protocol.md). Every request carries it as `v`.
const ProtocolVersion = 1

// DefaultMaxFrameBytes is the daemon's default request limit (max_frame_bytes). The client
// refuses larger requests itself, because the daemon's too_large reply cannot name the
// request it refused, and holds replies to the same bound so that one runaway length prefix
// cannot make it allocate without end.
const DefaultMaxFrameBytes = 16 << 20

// headerSize is the frame header: a 4-byte big-endian payload length.
const headerSize = 4

// Ops of protocol v1.
const (
	opPing           = "ping"
	opPrefetch       = "prefetch"
	opPrefetchBlocks = "prefetch_blocks"
	opCheck          = "check"
	opEvict          = "evict"
	opResolve        = "resolve"
	opStats          = "stats"
	opDoctor         = "doctor"
)

// Error codes of `ok: false` replies (docs/protocol.md, "Errors"). ServerError.Code holds
// one of these, or a newer daemon's code as it is.
const (
	CodeBadRequest         = "bad_request"
	CodeUnsupportedVersion = "unsupported_version"
	CodeUnknownOp          = "unknown_op"
	CodeTooLarge           = "too_large"
	CodeForbidden          = "forbidden"
	CodeOverloaded         = "overloaded"
	CodeInternal           = "internal"
)

// Per-file outcomes: the keys of PrefetchResult.Outcomes (docs/protocol.md).
const (
	OutcomeRead     = "read"
	OutcomeResident = "resident"
	OutcomeMissing  = "missing"
	OutcomeDropped  = "dropped"
	OutcomeRejected = "rejected"
	OutcomeFailed   = "failed"
	OutcomeExpired  = "expired"
	OutcomeFutile   = "futile" // read, but the root's file system drops it at the next open
)

// Frames are pooled: a router sends one per request, and a 1,000-path prefetch is about
// 100 KB. Very large ones are left to the garbage collector so the pool never pins them.
var framePool = sync.Pool{New: func() any { return new(bytes.Buffer) }}

const maxPooledFrame = 1 << 20

// newFrame returns an empty frame: room for the header, the payload to follow.
func newFrame() *bytes.Buffer {
	buf := framePool.Get().(*bytes.Buffer)
	buf.Reset()
	buf.Write([]byte{0, 0, 0, 0})
	return buf
}

func recycleFrame(buf *bytes.Buffer) {
	if buf != nil && buf.Cap() <= maxPooledFrame {
		framePool.Put(buf)
	}
}

// finishFrame seals a frame whose encoding ended with err; a frame that failed to
// encode or is over the limit goes back to the pool.
func finishFrame(buf *bytes.Buffer, err error, maxFrame int) (*bytes.Buffer, error) {
	if err == nil {
		err = sealFrame(buf, maxFrame)
	}
	if err != nil {
		recycleFrame(buf)
		return nil, err
	}
	return buf, nil
}

// sealFrame writes the payload length into the header, refusing frames above the limit.
func sealFrame(buf *bytes.Buffer, maxFrame int) error {
	n := buf.Len() - headerSize
	if n > maxFrame {
		return fmt.Errorf("%w: %d bytes, above the %d-byte frame limit; split the paths over several requests",
			ErrTooLarge, n, maxFrame)
	}
	binary.BigEndian.PutUint32(buf.Bytes()[:headerSize], uint32(n))
	return nil
}

// mapWriter hand-encodes a request map. It is used for prefetch, the router's hot path,
// where reflection over a struct per path would cost more than the bytes themselves.
// Errors stick: after the first, every later call is a no-op.
type mapWriter struct {
	enc *msgpack.Encoder
	err error
}

// put makes one encoder call, unless an earlier one failed.
func put[T any](w *mapWriter, encode func(*msgpack.Encoder, T) error, v T) {
	if w.err == nil {
		w.err = encode(w.enc, v)
	}
}

func (w *mapWriter) mapLen(n int)   { put(w, (*msgpack.Encoder).EncodeMapLen, n) }
func (w *mapWriter) arrayLen(n int) { put(w, (*msgpack.Encoder).EncodeArrayLen, n) }
func (w *mapWriter) str(s string)   { put(w, (*msgpack.Encoder).EncodeString, s) }
func (w *mapWriter) uint(n uint64)  { put(w, (*msgpack.Encoder).EncodeUint, n) }
func (w *mapWriter) bool(b bool)    { put(w, (*msgpack.Encoder).EncodeBool, b) }

// path writes a path as the protocol wants it: msgpack str when it is valid UTF-8, else
// bin, since a str must hold UTF-8 and Linux file names need not.
func (w *mapWriter) path(p string) {
	if utf8.ValidString(p) {
		w.str(p)
	} else {
		put(w, (*msgpack.Encoder).EncodeBytes, []byte(p))
	}
}

func (w *mapWriter) envelope(id uint64, op string) {
	w.str("v")
	w.uint(ProtocolVersion)
	w.str("id")
	w.uint(id)
	w.str("op")
	w.str(op)
}

// withEncoder runs fn with a pooled encoder writing into buf. Compact ints keep small
// numbers (ids, counts, token ids) to the fewest bytes, as the Python side writes them.
func withEncoder(buf *bytes.Buffer, fn func(*msgpack.Encoder) error) error {
	enc := msgpack.GetEncoder()
	defer msgpack.PutEncoder(enc)
	enc.Reset(buf)
	enc.UseCompactInts(true)
	return fn(enc)
}
