package plugin

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"github.com/gpudra/gpudra/pkg/prepared"
)

// migMarkers are the plugin's marks on the MIG devices it created: one
// small file per placement, written before the creation and kept until the
// device is destroyed. NVML has no place to label an instance, and the
// checkpoint may be lost or corrupt: a marker tells a rebuilt state which
// instances the driver created (and may destroy) and which claim they were
// created for, so that they are adopted rather than left foreign forever.
type migMarkers struct{ dir string }

// migMarker is one marker file.
type migMarker struct {
	ClaimUID string              `json:"claimUID"`
	Mig      prepared.CreatedMig `json:"mig"`
}

func (m migMarkers) path(parentUUID string, start int) string {
	return filepath.Join(m.dir, parentUUID+"-"+strconv.Itoa(start)+".json")
}

// put writes the marker atomically (rename). It is not synced: a kill of
// the plugin keeps what was written, and a crash of the node destroys every
// MIG device anyway (markers of an earlier boot are removed).
func (m migMarkers) put(claimUID string, mig prepared.CreatedMig) error {
	if err := os.MkdirAll(m.dir, 0o750); err != nil {
		return fmt.Errorf("MIG marker directory: %w", err)
	}
	b, err := json.Marshal(migMarker{ClaimUID: claimUID, Mig: mig})
	if err != nil {
		return err
	}
	path := m.path(mig.ParentUUID, mig.Start)
	tmp, err := os.CreateTemp(m.dir, ".marker-*")
	if err != nil {
		return fmt.Errorf("MIG marker: %w", err)
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(b); err != nil {
		tmp.Close()
		return fmt.Errorf("MIG marker: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("MIG marker: %w", err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("MIG marker: %w", err)
	}
	return nil
}

// remove deletes a marker; a missing one is not an error.
func (m migMarkers) remove(mig prepared.CreatedMig) error {
	if err := os.Remove(m.path(mig.ParentUUID, mig.Start)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove MIG marker: %w", err)
	}
	return nil
}

// list reads every marker. An unreadable marker is skipped with its error
// joined, so one damaged file does not hide the others.
func (m migMarkers) list() ([]migMarker, error) {
	entries, err := os.ReadDir(m.dir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list MIG markers: %w", err)
	}
	var out []migMarker
	var errs []error
	for _, e := range entries {
		if filepath.Ext(e.Name()) != ".json" || e.Name()[0] == '.' {
			continue
		}
		b, err := os.ReadFile(filepath.Join(m.dir, e.Name()))
		if err != nil {
			errs = append(errs, err)
			continue
		}
		var mk migMarker
		if err := json.Unmarshal(b, &mk); err != nil || mk.Mig.ParentUUID == "" {
			errs = append(errs, fmt.Errorf("MIG marker %s is unreadable: %v", e.Name(), err))
			continue
		}
		out = append(out, mk)
	}
	return out, errors.Join(errs...)
}
