// Package testwait holds the waiting the client's tests share: those inside the package,
// against a scripted fake daemon, and those outside it, against the real one. Nothing here
// asserts a time: the bounds only keep a broken test from hanging.
package testwait

import (
	"context"
	"testing"
	"time"
)

// Within returns a context that ends after d, or when t ends.
func Within(t testing.TB, d time.Duration) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	t.Cleanup(cancel)
	return ctx
}

// Eventually polls cond until it holds, failing t after a generous 30 s: the client works in
// the background (reconnects, fire-and-forget counts) and the machine may be shared.
func Eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}
