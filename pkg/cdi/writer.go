package cdi

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"

	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"
	cdispec "tags.cncf.io/container-device-interface/specs-go"
)

// Writer writes and removes claim specs in one CDI directory.
type Writer struct {
	cache *cdiapi.Cache
	dir   string
}

// NewWriter manages the specs in dir (created if missing).
func NewWriter(dir string) (*Writer, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("CDI directory %s: %w", dir, err)
	}
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(dir), cdiapi.WithAutoRefresh(false))
	if err != nil {
		return nil, fmt.Errorf("CDI cache over %s: %w", dir, err)
	}
	return &Writer{cache: cache, dir: dir}, nil
}

// SpecExt is the extension, and so the encoding, of the claim specs the
// writer writes: JSON, whose encoding costs a fraction of YAML's (the YAML
// encoder allocated 37 % of a whole prepare). legacySpecExt is what gpudra
// wrote before: runtimes read both, and the writer still finds and removes
// those a node kept from then.
const (
	SpecExt       = ".json"
	legacySpecExt = ".yaml"
)

// specExts are the extensions a claim's spec may have on disk.
var specExts = []string{SpecExt, legacySpecExt}

// Write stores the claim's spec atomically (the CDI library writes a
// temporary file and renames it), replacing an earlier one. A spec of the
// claim in the old encoding goes after the new one is in place: two specs
// defining the same CDI devices are a conflict, and a runtime resolves
// neither.
func (w *Writer) Write(claimUID string, spec *cdispec.Spec) error {
	if err := w.cache.WriteSpec(spec, SpecName(claimUID)+SpecExt); err != nil {
		return fmt.Errorf("write CDI spec for claim %s: %w", claimUID, err)
	}
	if err := removeIfExists(filepath.Join(w.dir, SpecName(claimUID)+legacySpecExt)); err != nil {
		return fmt.Errorf("remove the old CDI spec for claim %s: %w", claimUID, err)
	}
	return nil
}

// Remove deletes the claim's spec, in either encoding; a missing spec is
// not an error.
func (w *Writer) Remove(claimUID string) error {
	for _, ext := range specExts {
		if err := removeIfExists(filepath.Join(w.dir, SpecName(claimUID)+ext)); err != nil {
			return fmt.Errorf("remove CDI spec for claim %s: %w", claimUID, err)
		}
	}
	return nil
}

func removeIfExists(path string) error {
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	return nil
}

// Exists reports whether the claim has a spec on disk.
func (w *Writer) Exists(claimUID string) bool {
	for _, ext := range specExts {
		if _, err := os.Stat(filepath.Join(w.dir, SpecName(claimUID)+ext)); err == nil {
			return true
		}
	}
	return false
}

// Dir is the directory the writer manages.
func (w *Writer) Dir() string { return w.dir }

// ClaimUIDs lists the claims that have a spec in the directory, in either
// encoding, each once, so that the plugin can remove specs its checkpoint
// does not know (left by a kill, or by an earlier version).
func (w *Writer) ClaimUIDs() ([]string, error) {
	entries, err := os.ReadDir(w.dir)
	if err != nil {
		return nil, fmt.Errorf("list CDI specs: %w", err)
	}
	prefix := SpecName("")
	var uids []string
	for _, e := range entries {
		name := e.Name()
		ext := filepath.Ext(name)
		if !slices.Contains(specExts, ext) || !strings.HasPrefix(name, prefix) {
			continue
		}
		if uid := strings.TrimSuffix(strings.TrimPrefix(name, prefix), ext); !slices.Contains(uids, uid) {
			uids = append(uids, uid)
		}
	}
	return uids, nil
}
