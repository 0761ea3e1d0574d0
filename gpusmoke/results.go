package gpusmoke

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// results is the directory a run writes what it saw into (Config.Results);
// without one, nothing is written.
type results struct{ dir string }

func newResults(dir string) (*results, error) {
	if dir == "" {
		return &results{}, nil
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("the results directory: %w", err)
	}
	return &results{dir: dir}, nil
}

// write stores one file of the results, in a subdirectory where name has
// one.
func (r *results) write(name, content string) error {
	if r.dir == "" {
		return nil
	}
	path := filepath.Join(r.dir, name)
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil { //nolint:gosec // results are for people to read
		return fmt.Errorf("write results: %w", err)
	}
	return nil
}

func (r *results) writeJSON(name string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	return r.write(name, string(b)+"\n")
}

// inventory keeps the inventory as `gpudra inventory` prints it, as a
// table and as JSON.
func (r *results) inventory(inv *nvdevice.Inventory) error {
	var table strings.Builder
	if err := inv.WriteTable(&table); err != nil {
		return err
	}
	if err := r.write("inventory.txt", table.String()); err != nil {
		return err
	}
	return r.writeJSON("inventory.json", inv)
}

// writeResult writes RESULT: PASS, or FAIL and the reason.
func (r *results) writeResult(runErr error) error {
	if runErr != nil {
		return r.write(ResultFile, "FAIL: "+runErr.Error()+"\n")
	}
	return r.write(ResultFile, "PASS\n")
}
