package kvprefetch

// Deadlines and failure limits on the wire, without a daemon (daemon_test.go has the
// round trips through the real one).

import (
	"context"
	"testing"
	"time"
)

func TestDeadlineMSComesFromTheOptionsOrTheContext(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	cases := []struct {
		name string
		ctx  context.Context
		opts PrefetchOptions
		want int64 // -1: no deadline_ms sent
		slop int64 // the clock runs while the test does
	}{
		{"none", context.Background(), PrefetchOptions{}, -1, 0},
		{"the context's", ctx, PrefetchOptions{}, 2000, 50},
		{"explicit wins", ctx, PrefetchOptions{Deadline: time.Now().Add(300 * time.Millisecond)}, 300, 50},
		{"none at all", ctx, PrefetchOptions{NoDeadline: true}, 0, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			buf, err := encodePrefetch(1, []string{"/a"}, tc.opts, nil, deadlineOf(tc.opts, tc.ctx), DefaultMaxFrameBytes)
			if err != nil {
				t.Fatal(err)
			}
			m := decodeFrame(t, buf.Bytes())
			got, sent := m["deadline_ms"]
			if tc.want < 0 {
				if sent {
					t.Fatalf("deadline_ms sent: %v", m)
				}
				return
			}
			if n := toInt(got); !sent || n > tc.want || n < tc.want-tc.slop {
				t.Fatalf("deadline_ms %v, want %d (-%d)", got, tc.want, tc.slop)
			}
		})
	}
}

func TestAPastDeadlineIsSentAbsolute(t *testing.T) {
	past := time.Now().Add(-time.Second)
	opts := PrefetchOptions{Deadline: past}
	buf, err := encodePrefetch(1, []string{"/a"}, opts, nil, deadlineOf(opts, context.Background()), DefaultMaxFrameBytes)
	if err != nil {
		t.Fatal(err)
	}
	m := decodeFrame(t, buf.Bytes())
	if _, relative := m["deadline_ms"]; relative || toInt(m["deadline_unix_ms"]) != past.UnixMilli() {
		t.Fatalf("a past deadline: %v", m)
	}
}

func TestMaxFailuresRidesAlongAndBadOptionsAreRefused(t *testing.T) {
	buf, err := encodePrefetch(1, []string{"/a"}, PrefetchOptions{Wait: true, MaxFailures: 7}, nil, wireDeadline{}, DefaultMaxFrameBytes)
	if err != nil {
		t.Fatal(err)
	}
	if m := decodeFrame(t, buf.Bytes()); toInt(m["max_failures"]) != 7 {
		t.Fatalf("max_failures: %v", m)
	}
	for _, bad := range []PrefetchOptions{
		{MaxFailures: -1},
		{NoDeadline: true, Deadline: time.Now()},
	} {
		if bad.check() == nil {
			t.Fatalf("%+v accepted", bad)
		}
	}
}
