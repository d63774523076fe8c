package kvprefetch

import (
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strings"
	"testing"
)

// docs/protocol.md is the one source of the protocol's names; the daemon and the Python
// client are held to its tables by tests/unit/test_protocol_conformance.py, this client here.

// A name, or a field's path in a request (`layout.kv_cache_groups[].block_size`).
var docName = regexp.MustCompile("^`([a-z_][a-z_.\\[\\]]*)`$")

// docTables returns, per `## heading`, the first cell of every body row of its table.
// namedTables are the document's sections whose tables list names the client defines.
var namedTables = map[string]bool{"Requests": true, "Per-file outcomes": true, "Errors": true}

func docTables(t *testing.T) map[string][]string {
	t.Helper()
	text, err := os.ReadFile(filepath.Join("..", "..", "docs", "protocol.md"))
	if err != nil {
		t.Fatalf("reading the protocol document: %v", err)
	}
	tables := map[string][]string{}
	heading, header := "", false
	for _, line := range strings.Split(string(text), "\n") {
		switch {
		case strings.HasPrefix(line, "## "):
			heading, header = strings.TrimSpace(line[3:]), true
		case strings.HasPrefix(line, "|---"):
		case strings.HasPrefix(line, "|"):
			if !namedTables[heading] {
				continue // a table of something else (the stats keys' paths, ...)
			}
			if header { // the table's header row
				header = false
				continue
			}
			cell := strings.TrimSpace(strings.Split(strings.Trim(line, "|"), "|")[0])
			m := docName.FindStringSubmatch(cell)
			if m == nil {
				t.Fatalf("%s: not a `name` cell: %q", heading, cell)
			}
			tables[heading] = append(tables[heading], m[1])
		}
	}
	return tables
}

func TestNamesAreTheProtocolDocuments(t *testing.T) {
	tables := docTables(t)
	for _, c := range []struct {
		table string
		names []string
	}{
		{"Requests", []string{opPing, opPrefetch, opPrefetchBlocks, opCheck, opEvict, opResolve, opStats, opDoctor}},
		{"Per-file outcomes", []string{OutcomeRead, OutcomeResident, OutcomeMissing,
			OutcomeDropped, OutcomeRejected, OutcomeFailed, OutcomeExpired, OutcomeFutile}},
		{"Errors", []string{CodeBadRequest, CodeUnsupportedVersion, CodeUnknownOp,
			CodeTooLarge, CodeForbidden, CodeOverloaded, CodeInternal}},
	} {
		if !reflect.DeepEqual(tables[c.table], c.names) {
			t.Errorf("%s: the document says %v, the client %v", c.table, tables[c.table], c.names)
		}
	}
}
