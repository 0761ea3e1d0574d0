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
// directory, fsync, rename over the old one. A kill at any point leaves
// either the old or the new checkpoint, never a mix; so does a node crash
// (power loss, kernel panic): the new file's data is on disk before its name
// can replace the old one's.
//
// The directory is fsynced only when the rename creates the checkpoint
// (there was none: a new node, or one moved aside as corrupt). A rename
// over an existing checkpoint is not waited for: its only effect across a
// node crash would be which of two whole checkpoints of this boot the next
// boot finds, and Load discards a checkpoint of an earlier boot whichever it
// is (a reboot destroyed the MIG instances and CDI specs it names). The
// first store's directory fsync keeps "no checkpoint" meaning a lost one,
// never a node whose first store was not yet durable. A second fsync on
// every prepare and unprepare was the plugin's prepare tail
// (docs/benchmarks.md).
func Store(path string, c *Checkpoint) error {
	p, err := Stage(path, c)
	if err != nil {
		return err
	}
	return p.Commit()
}

// Pending is a checkpoint written and synced beside the one in place, not
// yet in its place (Stage, then Commit or Abort). Until Commit the old
// checkpoint is the checkpoint: a kill in between leaves only a temporary
// file, which RemoveStale removes.
type Pending struct {
	path, tmp string
}

// Stage writes the checkpoint to a temporary file in path's directory and
// fsyncs it.
func Stage(path string, c *Checkpoint) (*Pending, error) { return stage(path, c, true) }

// StageUnsynced is Stage without the fsync, for a change no power loss
// needs to find: a power loss is a reboot, and Load discards a checkpoint
// of an earlier boot, or moves aside one whose data the crash lost (the
// plugin rebuilds it from the node and the API). A kill keeps the page
// cache: the rename still gives the old or the new checkpoint, whole. The
// plugin uses it where the claim it records has no side effect but its
// CDI spec (docs/benchmarks.md, "Whole GPU, beside the DRA example
// driver").
func StageUnsynced(path string, c *Checkpoint) (*Pending, error) { return stage(path, c, false) }

func stage(path string, c *Checkpoint, sync bool) (*Pending, error) {
	out := *c
	out.Version = Version
	b, err := Marshal(&out)
	if err != nil {
		return nil, fmt.Errorf("encode checkpoint: %w", err)
	}
	tmp, err := writeTemp(path, b, 0o600, sync)
	if err != nil {
		return nil, fmt.Errorf("checkpoint: %w", err)
	}
	return &Pending{path: path, tmp: tmp}, nil
}

// Commit renames the staged checkpoint over the one in place; it fsyncs the
// directory only when there was none (see Store).
func (p *Pending) Commit() error {
	_, statErr := os.Lstat(p.path)
	if err := commit(p.path, p.tmp, errors.Is(statErr, os.ErrNotExist)); err != nil {
		return fmt.Errorf("checkpoint: %w", err)
	}
	return nil
}

// Abort removes the staged checkpoint; a nil Pending is none.
func (p *Pending) Abort() {
	if p != nil {
		_ = os.Remove(p.tmp)
	}
}

// tmpPattern names the temporary files beside path.
func tmpPattern(path string) string { return "." + filepath.Base(path) + ".tmp-*" }

// RemoveStale removes the temporary files a kill left beside the file at
// path (a store or a stage that never got to its rename). Call it where no
// store can run at the same time (under the node lock).
func RemoveStale(path string) error {
	stale, err := filepath.Glob(filepath.Join(filepath.Dir(path), tmpPattern(path)))
	if err != nil {
		return err
	}
	var errs []error
	for _, f := range stale {
		if err := os.Remove(f); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
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
	return writeFileAtomic(path, data, mode, true)
}

// syncDir fsyncs a directory (a variable: tests count the calls).
var syncDir = func(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}

func writeFileAtomic(path string, data []byte, mode os.FileMode, dirSync bool) error {
	tmp, err := writeTemp(path, data, mode, true)
	if err != nil {
		return err
	}
	return commit(path, tmp, dirSync)
}

// syncFile fsyncs a file (a variable: tests count the calls).
var syncFile = func(f *os.File) error { return f.Sync() }

// writeTemp writes data to a new temporary file beside path, with mode,
// and fsyncs it if sync; it returns the file's name.
func writeTemp(path string, data []byte, mode os.FileMode, sync bool) (name string, err error) {
	tmp, err := os.CreateTemp(filepath.Dir(path), tmpPattern(path))
	if err != nil {
		return "", fmt.Errorf("write %s: %w", path, err)
	}
	defer func() {
		if err != nil {
			os.Remove(tmp.Name())
		}
	}()
	// CreateTemp makes the file 0600: a chmod to that would be one more
	// journal update for nothing on the prepare path.
	if fi, err := tmp.Stat(); err != nil || fi.Mode().Perm() != mode {
		if err := tmp.Chmod(mode); err != nil {
			tmp.Close()
			return "", fmt.Errorf("write %s: %w", path, err)
		}
	}
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return "", fmt.Errorf("write %s: %w", path, err)
	}
	if sync {
		if err := syncFile(tmp); err != nil {
			tmp.Close()
			return "", fmt.Errorf("sync %s: %w", path, err)
		}
	}
	if err := tmp.Close(); err != nil {
		return "", fmt.Errorf("write %s: %w", path, err)
	}
	return tmp.Name(), nil
}

// commit renames the synced temporary file over path, then fsyncs the
// directory if dirSync.
func commit(path, tmp string, dirSync bool) error {
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("replace %s: %w", path, err)
	}
	if !dirSync {
		return nil
	}
	if err := syncDir(filepath.Dir(path)); err != nil {
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
