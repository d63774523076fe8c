package kvprefetch

import (
	"bytes"
	"fmt"
	"math"
	"time"

	"github.com/vmihailenco/msgpack/v5"
)

// reply is every field a v1 reply may carry; each op reads its own. Pointers tell a
// missing field from a zero, so a daemon that drifts from the protocol fails here with the
// field's name rather than later in the caller's code. Unknown keys are skipped, so a newer
// daemon may add figures.
type reply struct {
	ID    *uint64     `msgpack:"id"`
	OK    *bool       `msgpack:"ok"`
	Error *replyError `msgpack:"error"`

	Version  *string `msgpack:"version"`
	Protocol *int    `msgpack:"protocol"`
	Engine   *string `msgpack:"engine"`
	Workers  *int    `msgpack:"workers"`

	Accepted  *int           `msgpack:"accepted"`
	Dropped   *int           `msgpack:"dropped"`
	Rejected  *int           `msgpack:"rejected"`
	Outcomes  map[string]int `msgpack:"outcomes"`
	ElapsedUS *int64         `msgpack:"elapsed_us"`
	Files     *int           `msgpack:"files"`

	Failures          []failure `msgpack:"failures"`
	FailuresTruncated *int      `msgpack:"failures_truncated"`
	Room              *int      `msgpack:"room"`

	ResidentFiles *int           `msgpack:"resident_files"`
	SizeBytes     *int64         `msgpack:"size_bytes"`
	ResidentBytes *int64         `msgpack:"resident_bytes"`
	States        map[string]int `msgpack:"states"`
	EvictedFiles  *int           `msgpack:"evicted_files"`
	Results       []fileResult   `msgpack:"results"`

	BlockHashes [][]string `msgpack:"block_hashes"`
	Paths       []string   `msgpack:"paths"` // a bin path arrives as its bytes
	Fingerprint *string    `msgpack:"fingerprint"`

	Stats msgpack.RawMessage `msgpack:"stats"` // decoded only when asked for

	Host   msgpack.RawMessage `msgpack:"host"` // doctor's, decoded only when asked for
	Roots  msgpack.RawMessage `msgpack:"roots"`
	Useful *bool              `msgpack:"useful"`
}

type failure struct {
	Path    string `msgpack:"path"` // a bin path arrives as its bytes
	Outcome string `msgpack:"outcome"`
	Reason  string `msgpack:"reason"`
}

type fileResult struct {
	Path          string `msgpack:"path"`
	State         string `msgpack:"state"`
	Size          int64  `msgpack:"size"`
	ResidentBytes int64  `msgpack:"resident_bytes"`
	TierBytes     int64  `msgpack:"tier_bytes"`
	Reason        string `msgpack:"reason"`
}

type replyError struct {
	Code    string `msgpack:"code"`
	Message string `msgpack:"message"`
}

// decodeReply decodes one frame's payload into its one map.
func decodeReply(dec *msgpack.Decoder, src *bytes.Reader, payload []byte) (*reply, error) {
	src.Reset(payload)
	dec.Reset(src)
	r := new(reply)
	if err := dec.Decode(r); err != nil {
		return nil, &ProtocolError{Reason: "undecodable reply: " + err.Error()}
	}
	if src.Len() != 0 {
		return nil, &ProtocolError{Reason: "frame holds more than one msgpack value"}
	}
	return r, nil
}

// refusal tells the daemon's refusal of this peer: `forbidden` without an id, sent as it
// accepts a connection from a user it does not allow, before it closes it.
func (r *reply) refusal() bool {
	return r.ID == nil && r.OK != nil && !*r.OK && r.Error != nil && r.Error.Code == CodeForbidden
}

// check turns `ok: false` into a *ServerError.
func (r *reply) check() error {
	if r.OK == nil {
		return &ProtocolError{Reason: "reply without a boolean 'ok'"}
	}
	if *r.OK {
		return nil
	}
	if r.Error == nil {
		return &ProtocolError{Reason: "error reply without an 'error' map"}
	}
	e := &ServerError{Code: r.Error.Code, Message: r.Error.Message}
	if r.ID != nil {
		e.RequestID = *r.ID
	}
	return e
}

// field is a reply field an op requires, and whether the reply has it.
type field struct {
	name    string
	present bool
}

// required names the first required field the reply lacks.
func required(fields ...field) error {
	for _, f := range fields {
		if !f.present {
			return missing(f.name)
		}
	}
	return nil
}

func missing(name string) error {
	return &ProtocolError{Reason: "reply lacks '" + name + "'"}
}

func (r *reply) ping() (PingResult, error) {
	if err := required(field{"version", r.Version != nil}, field{"protocol", r.Protocol != nil},
		field{"engine", r.Engine != nil}, field{"workers", r.Workers != nil}); err != nil {
		return PingResult{}, err
	}
	return PingResult{Version: *r.Version, Protocol: *r.Protocol, Engine: *r.Engine, Workers: *r.Workers}, nil
}

func (r *reply) prefetch() (PrefetchResult, error) {
	if err := required(field{"accepted", r.Accepted != nil}, field{"dropped", r.Dropped != nil},
		field{"rejected", r.Rejected != nil}); err != nil {
		return PrefetchResult{}, err
	}
	res := PrefetchResult{Accepted: *r.Accepted, Dropped: *r.Dropped, Rejected: *r.Rejected, Outcomes: r.Outcomes}
	if r.ElapsedUS != nil {
		res.Elapsed = time.Duration(*r.ElapsedUS) * time.Microsecond
	}
	if r.Files != nil {
		res.Files = *r.Files
	}
	if len(r.Failures) > 0 {
		res.Failures = make([]Failure, len(r.Failures))
		for i, f := range r.Failures {
			res.Failures[i] = Failure(f)
		}
	}
	if r.FailuresTruncated != nil {
		res.FailuresTruncated = *r.FailuresTruncated
	}
	res.Room = -1
	if r.Room != nil {
		res.Room = *r.Room
	}
	return res, nil
}

func (r *reply) checkResult() (CheckResult, error) {
	if err := required(field{"files", r.Files != nil}, field{"resident_files", r.ResidentFiles != nil},
		field{"size_bytes", r.SizeBytes != nil}, field{"resident_bytes", r.ResidentBytes != nil},
		field{"states", r.States != nil}, field{"elapsed_us", r.ElapsedUS != nil}); err != nil {
		return CheckResult{}, err
	}
	res := CheckResult{
		Files: *r.Files, ResidentFiles: *r.ResidentFiles, SizeBytes: *r.SizeBytes,
		ResidentBytes: *r.ResidentBytes, States: r.States,
		Elapsed: time.Duration(*r.ElapsedUS) * time.Microsecond,
	}
	if r.EvictedFiles != nil {
		res.EvictedFiles = *r.EvictedFiles
	}
	if r.Results != nil {
		res.Results = make([]FileResult, len(r.Results))
		for i, f := range r.Results {
			res.Results[i] = FileResult(f)
		}
	}
	return res, nil
}

func (r *reply) resolution() (Resolution, error) {
	if err := required(field{"block_hashes", r.BlockHashes != nil}, field{"paths", r.Paths != nil}); err != nil {
		return Resolution{}, err
	}
	res := Resolution{BlockHashes: r.BlockHashes, Paths: r.Paths}
	if r.Fingerprint != nil {
		res.Fingerprint = *r.Fingerprint
	}
	return res, nil
}

// stats decodes the stats map with plain Go types: int64 (uint64 only above MaxInt64),
// float64, string, bool, nil, []any and map[string]any (a non-string key, should a daemon
// send one, becomes its text). msgpack's integer widths are the encoder's choice, so they
// are not passed on: a counter stays an int64 as it grows.
func (r *reply) stats() (map[string]any, error) {
	if len(r.Stats) == 0 {
		return nil, missing("stats")
	}
	dec := msgpack.NewDecoder(bytes.NewReader(r.Stats))
	dec.UseLooseInterfaceDecoding(true)
	dec.SetMapDecoder(decodeLooseMap)
	v, err := dec.DecodeInterfaceLoose()
	if err != nil {
		return nil, &ProtocolError{Reason: "undecodable stats: " + err.Error()}
	}
	m, ok := normalize(v).(map[string]any)
	if !ok {
		return nil, &ProtocolError{Reason: "'stats' is not a map"}
	}
	return m, nil
}

// doctor is the `doctor` reply as plain Go values: host, roots and useful.
func (r *reply) doctor() (map[string]any, error) {
	if len(r.Host) == 0 {
		return nil, missing("host")
	}
	if len(r.Roots) == 0 {
		return nil, missing("roots")
	}
	if r.Useful == nil {
		return nil, missing("useful")
	}
	out := map[string]any{"useful": *r.Useful}
	for name, raw := range map[string]msgpack.RawMessage{"host": r.Host, "roots": r.Roots} {
		dec := msgpack.NewDecoder(bytes.NewReader(raw))
		dec.UseLooseInterfaceDecoding(true)
		dec.SetMapDecoder(decodeLooseMap)
		v, err := dec.DecodeInterfaceLoose()
		if err != nil {
			return nil, &ProtocolError{Reason: "undecodable " + name + ": " + err.Error()}
		}
		out[name] = normalize(v)
	}
	if _, ok := out["host"].(map[string]any); !ok {
		return nil, &ProtocolError{Reason: "'host' is not a map"}
	}
	if _, ok := out["roots"].([]any); !ok {
		return nil, &ProtocolError{Reason: "'roots' is not an array"}
	}
	return out, nil
}

// normalize turns every integer that fits into an int64.
func normalize(v any) any {
	switch x := v.(type) {
	case uint64:
		if x <= math.MaxInt64 {
			return int64(x)
		}
	case []any:
		for i := range x {
			x[i] = normalize(x[i])
		}
	case map[string]any:
		for k := range x {
			x[k] = normalize(x[k])
		}
	}
	return v
}

// decodeLooseMap is the stats map decoder: string keys as they are, any other key as its
// text, so one odd key never makes the whole map undecodable.
func decodeLooseMap(d *msgpack.Decoder) (any, error) {
	n, err := d.DecodeMapLen()
	if err != nil || n < 0 {
		return nil, err
	}
	m := make(map[string]any, n)
	for i := 0; i < n; i++ {
		k, err := d.DecodeInterfaceLoose()
		if err != nil {
			return nil, err
		}
		v, err := d.DecodeInterfaceLoose()
		if err != nil {
			return nil, err
		}
		key, ok := k.(string)
		if !ok {
			key = fmt.Sprint(k)
		}
		m[key] = v
	}
	return m, nil
}
