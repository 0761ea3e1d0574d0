package checkpoint

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func sample(boot string) *Checkpoint {
	c := New(boot)
	c.Claims["uid-1"] = PreparedClaim{Namespace: "ns", Name: "c1", State: PrepareCompleted, Devices: []PreparedDevice{{
		Requests: []string{"gpu"}, Pool: "node-a", Device: "gpu-0-mig-3g-40gb-4", UUID: "MIG-x",
		CDIDeviceIDs: []string{"gpu.gpudra.dev/claim=uid-1-gpu-0-mig-3g-40gb-4"},
		CreatedMig:   &CreatedMig{ParentUUID: "GPU-a", Profile: "3g.40gb", Start: 4, GPUInstanceID: 2, UUID: "MIG-x"},
	}}}
	c.Claims["uid-2"] = PreparedClaim{Namespace: "ns", Name: "c2", State: PrepareStarted}
	return c
}

func TestStoreLoadRoundTrip(t *testing.T) {
	path := filepath.Join(t.TempDir(), "checkpoint.json")
	require.NoError(t, Store(path, sample("boot-1")))
	res, err := Load(path, "boot-1", time.Now())
	require.NoError(t, err)
	assert.Equal(t, sample("boot-1"), res.Checkpoint)
	assert.Empty(t, res.MovedAside)

	entries, err := os.ReadDir(filepath.Dir(path))
	require.NoError(t, err)
	assert.Len(t, entries, 1, "no temporary file is left behind")
}

func TestLoadMissingIsEmpty(t *testing.T) {
	res, err := Load(filepath.Join(t.TempDir(), "none.json"), "b", time.Now())
	require.NoError(t, err)
	assert.Empty(t, res.Checkpoint.Claims)
}

func TestLoadAfterRebootDiscards(t *testing.T) {
	path := filepath.Join(t.TempDir(), "checkpoint.json")
	require.NoError(t, Store(path, sample("boot-1")))
	res, err := Load(path, "boot-2", time.Now())
	require.NoError(t, err)
	assert.True(t, res.StaleBoot)
	assert.Empty(t, res.Checkpoint.Claims)
	assert.Equal(t, "boot-2", res.Checkpoint.BootID)
}

func TestCorruptCheckpointIsMovedAside(t *testing.T) {
	good, err := Marshal(sample("b"))
	require.NoError(t, err)
	flipped := append([]byte(nil), good...)
	flipped[len(flipped)/2] ^= 0x01
	tests := []struct {
		name    string
		content []byte
		want    string
	}{
		{"garbage", []byte("not json"), "checkpoint is corrupt: invalid character"},
		{"truncated", good[:len(good)/2], "checkpoint is corrupt: unexpected end of JSON input"},
		{"bit flip", flipped, "checkpoint is corrupt"},
		{"bad checksum", []byte(`{"checksum":1,"data":{"version":1,"bootID":"b","claims":{}}}`), "checkpoint is corrupt: checksum 00000001"},
		{"no data", []byte(`{"checksum":0}`), "checkpoint is corrupt: no data"},
		{"future version", envelopeFor(t, `{"version":9,"bootID":"b","claims":{}}`), "checkpoint is corrupt: version 9, this plugin reads version 1"},
		{"unknown field", envelopeFor(t, `{"version":1,"bootID":"b","claims":{},"extra":1}`), `checkpoint is corrupt: json: unknown field "extra"`},
		{"bad state", envelopeFor(t, `{"version":1,"bootID":"b","claims":{"u":{"state":"Half"}}}`), `checkpoint is corrupt: claim u has state "Half"`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, "checkpoint.json")
			require.NoError(t, os.WriteFile(path, tc.content, 0o600))
			res, err := Load(path, "b", time.Date(2026, 11, 22, 10, 0, 0, 0, time.UTC))
			require.NoError(t, err, "a corrupt checkpoint is not fatal")
			require.Error(t, res.Cause)
			assert.Contains(t, res.Cause.Error(), tc.want)
			assert.ErrorIs(t, res.Cause, ErrCorrupt)
			assert.Equal(t, path+".corrupt-20261122T100000000", res.MovedAside)
			kept, err := os.ReadFile(res.MovedAside)
			require.NoError(t, err)
			assert.Equal(t, tc.content, kept, "the damaged file is kept for a post-mortem")
			assert.NoFileExists(t, path)
			assert.Empty(t, res.Checkpoint.Claims)
		})
	}
}

func envelopeFor(t *testing.T, data string) []byte {
	t.Helper()
	return []byte(`{"checksum":` + itoa(crc(data)) + `,"data":` + data + `}`)
}

func TestBootID(t *testing.T) {
	proc := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(proc, "sys/kernel/random"), 0o755))
	require.NoError(t, os.WriteFile(filepath.Join(proc, "sys/kernel/random/boot_id"), []byte("abc-123\n"), 0o644))
	id, err := BootID(proc)
	require.NoError(t, err)
	assert.Equal(t, "abc-123", id)
}

func FuzzUnmarshal(f *testing.F) {
	good, _ := Marshal(sample("b"))
	f.Add(good)
	f.Add([]byte(`{"checksum":0,"data":null}`))
	f.Add([]byte(`{}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		c, err := Unmarshal(b)
		if err != nil {
			if c != nil {
				t.Fatal("a checkpoint together with an error")
			}
			return
		}
		// Whatever loads must store and load again to the same thing.
		again, err := Marshal(c)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := Unmarshal(again); err != nil {
			t.Fatalf("re-encoded checkpoint does not load: %v", err)
		}
	})
}
