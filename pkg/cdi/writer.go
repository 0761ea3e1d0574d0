package cdi

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
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

// Write stores the claim's spec atomically (the CDI library writes a
// temporary file and renames it), replacing an earlier one.
func (w *Writer) Write(claimUID string, spec *cdispec.Spec) error {
	if err := w.cache.WriteSpec(spec, SpecName(claimUID)); err != nil {
		return fmt.Errorf("write CDI spec for claim %s: %w", claimUID, err)
	}
	return nil
}

// Remove deletes the claim's spec; a missing spec is not an error.
func (w *Writer) Remove(claimUID string) error {
	for _, ext := range []string{".json", ".yaml"} {
		err := os.Remove(filepath.Join(w.dir, SpecName(claimUID)+ext))
		if err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("remove CDI spec for claim %s: %w", claimUID, err)
		}
	}
	return nil
}

// Exists reports whether the claim has a spec on disk.
func (w *Writer) Exists(claimUID string) bool {
	for _, ext := range []string{".json", ".yaml"} {
		if _, err := os.Stat(filepath.Join(w.dir, SpecName(claimUID)+ext)); err == nil {
			return true
		}
	}
	return false
}

// Dir is the directory the writer manages.
func (w *Writer) Dir() string { return w.dir }

// ClaimUIDs lists the claims that have a spec in the directory, so that the
// plugin can remove specs its checkpoint does not know (left by a kill).
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
		if (ext != ".json" && ext != ".yaml") || !strings.HasPrefix(name, prefix) {
			continue
		}
		uids = append(uids, strings.TrimSuffix(strings.TrimPrefix(name, prefix), ext))
	}
	return uids, nil
}
