package plugin

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sort"

	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/plugin/checkpoint"
)

// HealthFile is where the plugin keeps its unhealthy GPUs, in its data
// directory, so that a restart taints them again at once.
const HealthFile = "health.json"

// healthVersion is the version of the health file this release writes.
const healthVersion = 1

// healthRecord is the health file. Readers ignore fields they do not know,
// so a later release may add some without breaking an earlier one.
type healthRecord struct {
	Version int `json:"version"`
	// BootID is the boot the file was written in: a reboot resets every
	// GPU, so a file from another boot is discarded.
	BootID string `json:"bootID"`
	// Unhealthy: GPU UUID -> the event that made it unhealthy.
	Unhealthy map[string]nvdevice.HealthEvent `json:"unhealthy"`
}

// healthStore reads and writes the health file.
type healthStore struct {
	path   string
	bootID string
	// policy says which entries can make a GPU unhealthy: one an admin
	// has since made ignorable is dropped.
	policy nvdevice.XIDPolicy
}

// load returns the unhealthy GPUs the file holds for this boot. It never
// fails: a missing file, one from another boot and a corrupt one all give
// nothing (the last two logged), and the next save replaces the file.
// Entries that cannot make a GPU unhealthy are dropped.
func (s *healthStore) load(logger klog.Logger) map[string]nvdevice.HealthEvent {
	b, err := os.ReadFile(s.path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		logger.Error(err, "Could not read the unhealthy GPUs; starting without them", "path", s.path)
		return nil
	}
	var rec healthRecord
	if err := json.Unmarshal(b, &rec); err != nil {
		logger.Error(err, "Health file is corrupt; ignoring it", "path", s.path)
		return nil
	}
	if rec.BootID != s.bootID {
		logger.Info("Health file was written before a reboot, which reset the GPUs; ignoring it", "path", s.path,
			"fileBootID", rec.BootID, "bootID", s.bootID)
		return nil
	}
	out := make(map[string]nvdevice.HealthEvent, len(rec.Unhealthy))
	for uuid, ev := range rec.Unhealthy {
		if ev.GPUUUID == "" {
			ev.GPUUUID = uuid
		}
		if uuid == "" || ev.GPUUUID != uuid || !s.policy.Critical(ev) {
			logger.Info("Ignoring an entry of the health file that cannot make a GPU unhealthy", "path", s.path, "gpu", uuid, "kind", ev.Kind, "xid", ev.XID)
			continue
		}
		out[uuid] = ev
	}
	return out
}

// save writes the unhealthy GPUs atomically: a temporary file in the same
// directory, fsync, rename over the old file, fsync of the directory. A
// crash leaves the old file or the new one, never a mix.
func (s *healthStore) save(unhealthy map[string]nvdevice.HealthEvent) error {
	rec := healthRecord{Version: healthVersion, BootID: s.bootID, Unhealthy: unhealthy}
	if rec.Unhealthy == nil {
		rec.Unhealthy = map[string]nvdevice.HealthEvent{}
	}
	b, err := json.MarshalIndent(rec, "", "  ")
	if err != nil {
		return fmt.Errorf("encode health file: %w", err)
	}
	if err := checkpoint.WriteFileAtomic(s.path, b); err != nil {
		return fmt.Errorf("health file: %w", err)
	}
	return nil
}

func sortedUUIDs(m map[string]nvdevice.HealthEvent) []string {
	out := make([]string, 0, len(m))
	for u := range m {
		out = append(out, u)
	}
	sort.Strings(out)
	return out
}
