// Package checkpoint is the kubelet plugin's crash-safe record of what it
// prepared: versioned, checksummed, written atomically, two-phase per claim
// (prepare started / completed) so that a kill at any point can be resumed
// or rolled back, and tied to the boot it was written in.
package checkpoint

import (
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/gpudra/gpudra/pkg/prepared"
)

// Version is the format this code writes. It is the format release N-1
// reads (that release refuses fields it does not know and any other
// version), so a rolled-back plugin still finds every prepared claim.
//
// Compatibility rule from this release on: format changes are additive.
// A reader ignores fields it does not know and reads a newer version as far
// as it understands it; a field whose absence would make an older reader
// destroy something must not be added to this file (put it in a file of its
// own, as health and MIG markers are).
const Version = 1

// Checkpoint is the plugin's node state.
type Checkpoint struct {
	Version int `json:"version"`
	// BootID is /proc/sys/kernel/random/boot_id when written: after a
	// reboot MIG instances and CDI specs in tmpfs are gone, so the record
	// no longer describes the node.
	BootID string `json:"bootID"`
	// Claims are keyed by claim UID.
	Claims map[string]prepared.Claim `json:"claims"`
}

// Claim returns the record of a claim with its UID set.
func (c *Checkpoint) Claim(uid string) (prepared.Claim, bool) {
	cl, ok := c.Claims[uid]
	cl.UID = uid
	return cl, ok
}

// Put stores a claim's record under its UID.
func (c *Checkpoint) Put(cl prepared.Claim) { c.Claims[cl.UID] = cl }

// Others lists every claim but the one with uid, UIDs set.
func (c *Checkpoint) Others(uid string) []prepared.Claim {
	out := make([]prepared.Claim, 0, len(c.Claims))
	for u := range c.Claims {
		if u != uid {
			cl, _ := c.Claim(u)
			out = append(out, cl)
		}
	}
	return out
}

// New returns an empty checkpoint for this boot.
func New(bootID string) *Checkpoint {
	return &Checkpoint{Version: Version, BootID: bootID, Claims: map[string]prepared.Claim{}}
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

// Unmarshal decodes and verifies a checkpoint. Damage (bad JSON, a checksum
// mismatch, an unknown claim state) gives an error wrapping ErrCorrupt.
// Fields it does not know are ignored and a newer version is read as far as
// this release understands it (see Version); an older one is migrated.
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
	var c Checkpoint
	if err := json.Unmarshal(env.Data, &c); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrCorrupt, err)
	}
	if c.Version < 1 {
		return nil, fmt.Errorf("%w: version %d: no release wrote it", ErrCorrupt, c.Version)
	}
	// Migrations from older versions go here, oldest first. There is none
	// yet: version 1 is the first released format. A newer version keeps
	// its number in memory only; Store writes Version.
	if c.Claims == nil {
		c.Claims = map[string]prepared.Claim{}
	}
	for uid, claim := range c.Claims {
		if claim.State != prepared.PrepareStarted && claim.State != prepared.PrepareCompleted {
			return nil, fmt.Errorf("%w: claim %s has state %q", ErrCorrupt, uid, claim.State)
		}
	}
	return &c, nil
}

// Store writes the checkpoint atomically: a temporary file in the same
// directory, fsync, rename over the old one, fsync of the directory. A kill
// at any point leaves either the old or the new checkpoint, never a mix.
func Store(path string, c *Checkpoint) error {
	out := *c
	out.Version = Version
	b, err := Marshal(&out)
	if err != nil {
		return fmt.Errorf("encode checkpoint: %w", err)
	}
	if err := WriteFileAtomic(path, b); err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	return nil
}

// WriteFileAtomic replaces the file at path with data: a temporary file in
// the same directory, fsync, rename over the old one, fsync of the
// directory. A kill at any point leaves either the old or the new file,
// never a mix. The plugin's other node files (health) use it too.
func WriteFileAtomic(path string, data []byte) error { return WriteFileAtomicMode(path, data, 0o600) }

// WriteFileAtomicMode is WriteFileAtomic with the file's permissions (set
// before the rename, so the file never has others): gpudra local's state,
// which every user of the machine's group reads.
func WriteFileAtomicMode(path string, data []byte, mode os.FileMode) error {
	dir := filepath.Dir(path)
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	defer os.Remove(tmp.Name()) // no-op after a successful rename
	if err := tmp.Chmod(mode); err != nil {
		tmp.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return fmt.Errorf("sync %s: %w", path, err)
	}
	if err := tmp.Close(); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	if err := os.Rename(tmp.Name(), path); err != nil {
		return fmt.Errorf("replace %s: %w", path, err)
	}
	d, err := os.Open(dir)
	if err != nil {
		return fmt.Errorf("sync directory of %s: %w", path, err)
	}
	defer d.Close()
	if err := d.Sync(); err != nil {
		return fmt.Errorf("sync directory of %s: %w", path, err)
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
