// Package checkpoint is the kubelet plugin's crash-safe record of what it
// prepared: versioned, checksummed, written atomically, two-phase per claim
// (prepare started / completed) so that a kill at any point can be resumed
// or rolled back, and tied to the boot it was written in.
package checkpoint

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"strings"
	"time"

	gpuapi "github.com/gpudra/gpudra/api/gpu/v1alpha1"
)

// Version is the format this code writes. Older versions are migrated on
// load; newer ones are refused as corrupt rather than misread.
const Version = 1

// ClaimState is where a claim is in its two-phase prepare.
type ClaimState string

const (
	// PrepareStarted: side effects (MIG instances, CDI spec) may exist in
	// part; on restart they are rolled back or completed.
	PrepareStarted ClaimState = "PrepareStarted"
	// PrepareCompleted: everything was done and returned to the kubelet.
	PrepareCompleted ClaimState = "PrepareCompleted"
)

// Checkpoint is the plugin's node state.
type Checkpoint struct {
	Version int `json:"version"`
	// BootID is /proc/sys/kernel/random/boot_id when written: after a
	// reboot MIG instances and CDI specs in tmpfs are gone, so the record
	// no longer describes the node.
	BootID string                   `json:"bootID"`
	Claims map[string]PreparedClaim `json:"claims"`
}

// PreparedClaim is one claim's record, keyed by claim UID.
type PreparedClaim struct {
	Namespace string           `json:"namespace"`
	Name      string           `json:"name"`
	State     ClaimState       `json:"state"`
	Devices   []PreparedDevice `json:"devices"`
	// Sharing is the claim's sharing configuration, kept so that what it
	// set up (an MPS daemon, a time slice, an IPC directory) can be found
	// and undone after a restart. Absent: exclusive.
	Sharing *gpuapi.Sharing `json:"sharing,omitempty"`
}

// PreparedDevice is one device prepared for a claim.
type PreparedDevice struct {
	Requests     []string `json:"requests"`
	Pool         string   `json:"pool"`
	Device       string   `json:"device"`
	UUID         string   `json:"uuid,omitempty"`
	CDIDeviceIDs []string `json:"cdiDeviceIDs,omitempty"`
	// CreatedMig records a MIG device the plugin created for the claim:
	// its ids and UUID are not deterministic, so they are kept here to
	// destroy exactly that instance later.
	CreatedMig *CreatedMig `json:"createdMig,omitempty"`
	// GPUUUID is the physical GPU (the parent of a MIG device).
	GPUUUID string `json:"gpuUUID,omitempty"`
	// Mig says the device is a MIG device.
	Mig bool `json:"mig,omitempty"`
	// MemoryBytes and Multiprocessors are the device's, or its share's.
	MemoryBytes     int64 `json:"memoryBytes,omitempty"`
	Multiprocessors int64 `json:"multiprocessors,omitempty"`
	// Share is set for a consumable-capacity share of a GPU.
	Share *Share `json:"share,omitempty"`
}

// Share is what a claim consumes of a GPU that several claims share.
type Share struct {
	ID                 string `json:"id"`
	MemoryBytes        int64  `json:"memoryBytes"`
	Multiprocessors    int64  `json:"multiprocessors"`
	GPUMultiprocessors int64  `json:"gpuMultiprocessors"`
}

// CreatedMig identifies a MIG device the plugin created.
type CreatedMig struct {
	ParentUUID        string `json:"parentUUID"`
	Profile           string `json:"profile"`
	Start             int    `json:"start"`
	GPUInstanceID     int    `json:"gpuInstanceID"`
	ComputeInstanceID int    `json:"computeInstanceID"`
	UUID              string `json:"uuid"`
}

// New returns an empty checkpoint for this boot.
func New(bootID string) *Checkpoint {
	return &Checkpoint{Version: Version, BootID: bootID, Claims: map[string]PreparedClaim{}}
}

// envelope carries the checksum of the exact bytes of the data.
type envelope struct {
	Checksum uint32          `json:"checksum"`
	Data     json.RawMessage `json:"data"`
}

// ErrCorrupt marks a checkpoint that cannot be trusted.
var ErrCorrupt = errors.New("checkpoint is corrupt")

// Marshal encodes a checkpoint with its checksum.
func Marshal(c *Checkpoint) ([]byte, error) {
	data, err := json.Marshal(c)
	if err != nil {
		return nil, err
	}
	return json.Marshal(envelope{Checksum: crc32.ChecksumIEEE(data), Data: data})
}

// Unmarshal decodes and verifies a checkpoint. Any damage, an unknown field
// or a version it does not know gives an error wrapping ErrCorrupt.
func Unmarshal(b []byte) (*Checkpoint, error) {
	var env envelope
	if err := json.Unmarshal(b, &env); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrCorrupt, err)
	}
	if len(env.Data) == 0 {
		return nil, fmt.Errorf("%w: no data", ErrCorrupt)
	}
	if sum := crc32.ChecksumIEEE(env.Data); sum != env.Checksum {
		return nil, fmt.Errorf("%w: checksum %08x, data hashes to %08x", ErrCorrupt, env.Checksum, sum)
	}
	dec := json.NewDecoder(bytes.NewReader(env.Data))
	dec.DisallowUnknownFields()
	var c Checkpoint
	if err := dec.Decode(&c); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrCorrupt, err)
	}
	if c.Version != Version {
		return nil, fmt.Errorf("%w: version %d, this plugin reads version %d", ErrCorrupt, c.Version, Version)
	}
	if c.Claims == nil {
		c.Claims = map[string]PreparedClaim{}
	}
	for uid, claim := range c.Claims {
		if claim.State != PrepareStarted && claim.State != PrepareCompleted {
			return nil, fmt.Errorf("%w: claim %s has state %q", ErrCorrupt, uid, claim.State)
		}
	}
	return &c, nil
}

// Store writes the checkpoint atomically: a temporary file in the same
// directory, fsync, rename over the old one, fsync of the directory. A kill
// at any point leaves either the old or the new checkpoint, never a mix.
func Store(path string, c *Checkpoint) error {
	b, err := Marshal(c)
	if err != nil {
		return fmt.Errorf("encode checkpoint: %w", err)
	}
	dir := filepath.Dir(path)
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("write checkpoint: %w", err)
	}
	defer os.Remove(tmp.Name()) // no-op after a successful rename
	if _, err := tmp.Write(b); err != nil {
		tmp.Close()
		return fmt.Errorf("write checkpoint: %w", err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return fmt.Errorf("sync checkpoint: %w", err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("write checkpoint: %w", err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("replace checkpoint: %w", err)
	}
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("sync checkpoint directory: %w", err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("sync checkpoint directory: %w", err)
	}
	return nil
}

// LoadResult says what Load found.
type LoadResult struct {
	Checkpoint *Checkpoint
	// MovedAside is where a corrupt checkpoint was moved, empty otherwise.
	MovedAside string
	// Cause is why it was moved aside.
	Cause error
	// StaleBoot is true when the checkpoint was written before a reboot
	// and has been discarded.
	StaleBoot bool
}

// Load reads the checkpoint at path for this boot. A missing file gives an
// empty checkpoint. A corrupt one is moved aside (path.corrupt-<time>) and
// an empty checkpoint is returned with the cause, so that the plugin can
// report it and rebuild its state instead of crash-looping. Only an I/O
// error that leaves the file in place is returned as an error.
func Load(path, bootID string, now time.Time) (LoadResult, error) {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return LoadResult{Checkpoint: New(bootID)}, nil
	}
	if err != nil {
		return LoadResult{}, fmt.Errorf("read checkpoint %s: %w", path, err)
	}
	c, cause := Unmarshal(b)
	if cause != nil {
		aside := path + ".corrupt-" + strings.ReplaceAll(now.UTC().Format("20060102T150405.000"), ".", "")
		if err := os.Rename(path, aside); err != nil {
			return LoadResult{}, fmt.Errorf("move corrupt checkpoint %s aside (%v): %w", path, cause, err)
		}
		return LoadResult{Checkpoint: New(bootID), MovedAside: aside, Cause: cause}, nil
	}
	if c.BootID != bootID {
		return LoadResult{Checkpoint: New(bootID), StaleBoot: true}, nil
	}
	return LoadResult{Checkpoint: c}, nil
}

// BootID reads the kernel's boot id.
func BootID(procRoot string) (string, error) {
	b, err := os.ReadFile(filepath.Join(procRoot, "sys/kernel/random/boot_id"))
	if err != nil {
		return "", fmt.Errorf("read boot id: %w", err)
	}
	return strings.TrimSpace(string(b)), nil
}
