package checkpoint

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// countDirSyncs counts the directory fsyncs of the test.
func countDirSyncs(t *testing.T) *int {
	n := 0
	orig := syncDir
	syncDir = func(dir string) error { n++; return orig(dir) }
	t.Cleanup(func() { syncDir = orig })
	return &n
}

// The store that creates the checkpoint waits for its directory entry, so
// that after a node crash a missing checkpoint still means a lost one; a
// store over an existing checkpoint does not (a checkpoint of an earlier
// boot is discarded whichever of two whole ones the next boot finds). The
// shared helper every other node file uses still syncs its directory.
func TestStoreSyncsTheDirectoryOnlyWhenItCreatesTheCheckpoint(t *testing.T) {
	syncs := countDirSyncs(t)
	path := filepath.Join(t.TempDir(), "checkpoint.json")
	require.NoError(t, Store(path, sample("boot-1")))
	assert.Equal(t, 1, *syncs, "the first store creates the checkpoint")
	require.NoError(t, Store(path, New("boot-1")))
	assert.Equal(t, 1, *syncs, "a store over an existing checkpoint")

	require.NoError(t, os.Rename(path, path+".corrupt-x"))
	require.NoError(t, Store(path, New("boot-1")))
	assert.Equal(t, 2, *syncs, "the store after a checkpoint was moved aside creates it again")

	other := filepath.Join(filepath.Dir(path), "health.json")
	require.NoError(t, WriteFileAtomic(other, []byte("{}")))
	require.NoError(t, WriteFileAtomic(other, []byte("{}")))
	assert.Equal(t, 4, *syncs, "WriteFileAtomic syncs every time")
}

func TestStageCommitAbort(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "checkpoint.json")
	require.NoError(t, Store(path, New("boot-1")))

	p, err := Stage(path, sample("boot-1"))
	require.NoError(t, err)
	res, err := Load(path, "boot-1", time.Now())
	require.NoError(t, err)
	assert.Empty(t, res.Checkpoint.Claims, "a staged checkpoint is not the checkpoint")
	require.NoError(t, p.Commit())
	res, err = Load(path, "boot-1", time.Now())
	require.NoError(t, err)
	assert.Equal(t, sample("boot-1"), res.Checkpoint)

	p, err = Stage(path, New("boot-1"))
	require.NoError(t, err)
	p.Abort()
	(*Pending)(nil).Abort()
	res, err = Load(path, "boot-1", time.Now())
	require.NoError(t, err)
	assert.Equal(t, sample("boot-1"), res.Checkpoint, "an aborted stage changes nothing")
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	assert.Len(t, entries, 1, "and leaves no file")
}

// A kill between a stage (or a store's write) and its rename leaves a
// temporary file; RemoveStale removes those, and nothing else.
func TestRemoveStale(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "checkpoint.json")
	require.NoError(t, Store(path, sample("boot-1")))
	_, err := Stage(path, New("boot-1")) // killed before its commit
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, ".health.json.tmp-1"), nil, 0o600))
	require.NoError(t, os.WriteFile(filepath.Join(dir, "checkpoint.json.corrupt-x"), nil, 0o600))
	require.NoError(t, RemoveStale(path))
	var names []string
	entries, err := os.ReadDir(dir)
	require.NoError(t, err)
	for _, e := range entries {
		names = append(names, e.Name())
	}
	assert.Equal(t, []string{".health.json.tmp-1", "checkpoint.json", "checkpoint.json.corrupt-x"}, names)
	res, err := Load(path, "boot-1", time.Now())
	require.NoError(t, err)
	assert.Equal(t, sample("boot-1"), res.Checkpoint)
	require.NoError(t, RemoveStale(filepath.Join(t.TempDir(), "checkpoint.json")), "nothing to remove")
}

// The chmod is skipped where CreateTemp already made the file's mode, and
// only there.
func TestFileModes(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "checkpoint.json")
	require.NoError(t, Store(path, New("boot-1")))
	fi, err := os.Stat(path)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o600), fi.Mode().Perm())

	shared := filepath.Join(dir, "state.json")
	require.NoError(t, WriteFileAtomicMode(shared, []byte("{}"), 0o640))
	fi, err = os.Stat(shared)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o640), fi.Mode().Perm())
}

// A staged checkpoint is fsynced by Stage and not by StageUnsynced; both
// commit a whole checkpoint that Load reads back.
func TestStageUnsyncedSkipsTheFileSync(t *testing.T) {
	n := 0
	orig := syncFile
	syncFile = func(f *os.File) error { n++; return orig(f) }
	t.Cleanup(func() { syncFile = orig })
	path := filepath.Join(t.TempDir(), "checkpoint.json")

	p, err := Stage(path, sample("boot-1"))
	require.NoError(t, err)
	require.NoError(t, p.Commit())
	assert.Equal(t, 1, n, "Stage fsyncs the file")

	p, err = StageUnsynced(path, sample("boot-1"))
	require.NoError(t, err)
	require.NoError(t, p.Commit())
	assert.Equal(t, 1, n, "StageUnsynced does not")
	res, err := Load(path, "boot-1", time.Now())
	require.NoError(t, err)
	assert.Equal(t, sample("boot-1").Claims, res.Checkpoint.Claims)
}
