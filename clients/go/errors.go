package kvprefetch

import (
	"errors"
	"fmt"
)

// What can go wrong, as sentinels for errors.Is. The split follows what a caller does
// about it: nothing (ErrDropped: a warm-up is a hint), wait and retry (ErrUnavailable,
// ErrConnectionLost), fix the request (ErrTooLarge, *ServerError with bad_request), or
// report a bug (*ProtocolError).
var (
	// ErrClosed: the client was closed.
	ErrClosed = errors.New("kvprefetch: client closed")
	// ErrUnavailable: no connection to the daemon came up in time (it is down or
	// restarting; the client keeps redialling in the background).
	ErrUnavailable = errors.New("kvprefetch: daemon unavailable")
	// ErrDropped: a fire-and-forget request was not sent. Drops are counted
	// (Counters.Dropped), never retried.
	ErrDropped = errors.New("kvprefetch: fire-and-forget request dropped")
	// ErrConnectionLost: the connection broke after the request was written; whether the
	// daemon acted on it is unknown.
	ErrConnectionLost = errors.New("kvprefetch: connection lost before the reply")
	// ErrTooLarge: the request is above the frame limit and was not sent.
	ErrTooLarge = errors.New("kvprefetch: request too large")
)

// ServerError is the daemon's `ok: false` reply. Code stays a plain string so that a newer
// daemon's codes still reach the caller.
//
// A daemon that does not allow this peer refuses each connection as it accepts it
// (CodeForbidden): every call then fails with that refusal, whether or not its request went
// out (RequestID is 0 when it did not), until a connection is accepted again.
type ServerError struct {
	Code      string // CodeBadRequest, CodeOverloaded, ...
	Message   string
	RequestID uint64
}

func (e *ServerError) Error() string {
	return fmt.Sprintf("kvprefetchd: %s: %s", e.Code, e.Message)
}

// ProtocolError means the bytes on the wire broke the framing or the reply schema of
// protocol v1. The connection it happened on is closed and replaced.
type ProtocolError struct {
	Reason string
}

func (e *ProtocolError) Error() string {
	return "kvprefetch: protocol error: " + e.Reason
}

// DroppedError is what a fire-and-forget call returns when it did not send: it matches
// ErrDropped, and unwraps to why (ErrUnavailable, ErrClosed, ErrTooLarge, or the context's
// or the send deadline's context.DeadlineExceeded when every slot was busy).
type DroppedError struct {
	Cause error
}

func (e *DroppedError) Error() string { return ErrDropped.Error() + ": " + e.Cause.Error() }

// Is makes errors.Is(err, ErrDropped) true; the cause is reached through Unwrap.
func (e *DroppedError) Is(target error) bool { return target == ErrDropped }

func (e *DroppedError) Unwrap() error { return e.Cause }

// unavailableError is ErrUnavailable with why: the context's error, and the last dial error
// so the caller sees "no such file or directory" rather than only a timeout.
type unavailableError struct {
	cause   error
	lastErr error
}

func (e *unavailableError) Error() string {
	msg := ErrUnavailable.Error() + ": " + e.cause.Error()
	if e.lastErr != nil {
		msg += " (last attempt: " + e.lastErr.Error() + ")"
	}
	return msg
}

func (e *unavailableError) Is(target error) bool { return target == ErrUnavailable }

func (e *unavailableError) Unwrap() error { return e.cause }

// lostError is ErrConnectionLost with the connection's own error.
type lostError struct {
	cause error
}

func (e *lostError) Error() string { return ErrConnectionLost.Error() + ": " + e.cause.Error() }

func (e *lostError) Is(target error) bool { return target == ErrConnectionLost }

func (e *lostError) Unwrap() error { return e.cause }

// errNotSent: the connection died before the writer took the frame, so sending it again on
// another connection cannot make the daemon act twice. Never returned to callers.
var errNotSent = errors.New("kvprefetch: connection closed before the request was sent")
