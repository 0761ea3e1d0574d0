package checkpoint

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	gpuapi "github.com/gpudra/gpudra/api/gpu/v1alpha1"
	"github.com/gpudra/gpudra/pkg/prepared"
)

func sample(boot string) *Checkpoint {
	c := New(boot)
	c.Claims["uid-1"] = prepared.Claim{Namespace: "ns", Name: "c1", State: prepared.PrepareCompleted, Devices: []prepared.Device{{
		Requests: []string{"gpu"}, Pool: "node-a", Device: "gpu-0-mig-3g-40gb-4", UUID: "MIG-x",
		CDIDeviceIDs: []string{"gpu.gpudra.dev/claim=uid-1-gpu-0-mig-3g-40gb-4"},
		CreatedMig:   &prepared.CreatedMig{ParentUUID: "GPU-a", Profile: "3g.40gb", Start: 4, GPUInstanceID: 2, UUID: "MIG-x"},
		GPUUUID:      "GPU-a", Mig: true, MemoryBytes: 40 << 30, Multiprocessors: 60,
	}}, Sharing: &gpuapi.Sharing{Strategy: gpuapi.MPS, IPC: true}}
	c.Claims["uid-2"] = prepared.Claim{Namespace: "ns", Name: "c2", State: prepared.PrepareStarted, Devices: []prepared.Device{{
		Requests: []string{"gpu"}, Pool: "node-a", Device: "gpu-3", UUID: "GPU-d", GPUUUID: "GPU-d",
		Share: &prepared.Share{ID: "s1", MemoryBytes: 20 << 30, Multiprocessors: 33, GPUMultiprocessors: 132},
	}}}
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
		{"no version", envelopeFor(t, `{"bootID":"b","claims":{}}`), "checkpoint is corrupt: version 0: no release wrote it"},
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

// releaseN1 is the checkpoint reader of the release before this one, frozen
// here: it refuses unknown fields and any version but 1. What this release
// writes must load there, so that a rollback of the plugin finds every
// prepared claim instead of treating the file as corrupt.
type releaseN1 struct {
	Version int                       `json:"version"`
	BootID  string                    `json:"bootID"`
	Claims  map[string]releaseN1Claim `json:"claims"`
}

type releaseN1Claim struct {
	Namespace string            `json:"namespace"`
	Name      string            `json:"name"`
	State     string            `json:"state"`
	Devices   []releaseN1Device `json:"devices"`
	Sharing   *gpuapi.Sharing   `json:"sharing,omitempty"`
}

type releaseN1Device struct {
	Requests     []string `json:"requests"`
	Pool         string   `json:"pool"`
	Device       string   `json:"device"`
	UUID         string   `json:"uuid,omitempty"`
	CDIDeviceIDs []string `json:"cdiDeviceIDs,omitempty"`
	CreatedMig   *struct {
		ParentUUID        string `json:"parentUUID"`
		Profile           string `json:"profile"`
		Start             int    `json:"start"`
		GPUInstanceID     int    `json:"gpuInstanceID"`
		ComputeInstanceID int    `json:"computeInstanceID"`
		UUID              string `json:"uuid"`
	} `json:"createdMig,omitempty"`
	GPUUUID         string `json:"gpuUUID,omitempty"`
	Mig             bool   `json:"mig,omitempty"`
	MemoryBytes     int64  `json:"memoryBytes,omitempty"`
	Multiprocessors int64  `json:"multiprocessors,omitempty"`
	Share           *struct {
		ID                 string `json:"id"`
		MemoryBytes        int64  `json:"memoryBytes"`
		Multiprocessors    int64  `json:"multiprocessors"`
		GPUMultiprocessors int64  `json:"gpuMultiprocessors"`
	} `json:"share,omitempty"`
}

func readAsReleaseN1(b []byte) (*releaseN1, error) {
	var env envelope
	if err := json.Unmarshal(b, &env); err != nil {
		return nil, err
	}
	dec := json.NewDecoder(bytes.NewReader(env.Data))
	dec.DisallowUnknownFields()
	var c releaseN1
	if err := dec.Decode(&c); err != nil {
		return nil, err
	}
	if c.Version != 1 {
		return nil, fmt.Errorf("version %d, this plugin reads version 1", c.Version)
	}
	return &c, nil
}

func TestPreviousReleaseReadsWhatThisOneWrites(t *testing.T) {
	path := filepath.Join(t.TempDir(), "checkpoint.json")
	require.NoError(t, Store(path, sample("b")))
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	old, err := readAsReleaseN1(b)
	require.NoError(t, err, "release N-1 must read this release's checkpoint")
	require.Len(t, old.Claims, 2)
	c1 := old.Claims["uid-1"]
	assert.Equal(t, "PrepareCompleted", c1.State)
	require.Len(t, c1.Devices, 1)
	require.NotNil(t, c1.Devices[0].CreatedMig)
	assert.Equal(t, 4, c1.Devices[0].CreatedMig.Start)
	assert.Equal(t, "s1", old.Claims["uid-2"].Devices[0].Share.ID)
}

func TestNewerVersionIsReadNotDestroyed(t *testing.T) {
	// Release N+1 adds fields at every level and bumps the version: this
	// release reads what it knows and keeps every claim.
	newer := `{"version":2,"bootID":"b","nodeHealth":{"x":1},"claims":{"u1":{"namespace":"ns","name":"c","state":"PrepareCompleted",` +
		`"adminAccess":true,"devices":[{"requests":["gpu"],"pool":"p","device":"gpu-1","uuid":"GPU-1","cdiDeviceIDs":["x"],` +
		`"createdMig":{"parentUUID":"GPU-0","profile":"1g.10gb","start":6,"gpuInstanceID":9,"computeInstanceID":0,"uuid":"MIG-y","marker":"m"},` +
		`"vfioGroup":7}]}}}`
	dir := t.TempDir()
	path := filepath.Join(dir, "checkpoint.json")
	require.NoError(t, os.WriteFile(path, envelopeFor(t, newer), 0o600))
	res, err := Load(path, "b", time.Now())
	require.NoError(t, err)
	require.NoError(t, res.Cause, "a newer checkpoint is not corrupt")
	assert.Empty(t, res.MovedAside)
	c, ok := res.Checkpoint.Claim("u1")
	require.True(t, ok)
	assert.Equal(t, "u1", c.UID)
	assert.Equal(t, prepared.PrepareCompleted, c.State)
	require.Len(t, c.Devices, 1)
	assert.Equal(t, "GPU-1", c.Devices[0].UUID)
	assert.Equal(t, 6, c.Devices[0].CreatedMig.Start)
	assert.Equal(t, 9, c.Devices[0].CreatedMig.GPUInstanceID)

	// Stored again, it is in this release's format, which N-1 reads too.
	require.NoError(t, Store(path, res.Checkpoint))
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	_, err = readAsReleaseN1(b)
	require.NoError(t, err)
}
