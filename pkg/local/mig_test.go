package local

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
)

// newLocalMIG is a simulated DGX H100 in MIG mode whose local state
// creates MIG devices through the machine.
func newLocalMIG(t *testing.T) (*Local, *sim.Machine) {
	t.Helper()
	l, m, _ := openLocal(t, "dgx-h100", true, nil)
	return l, m
}

func migUUIDs(m *sim.Machine) []string {
	var out []string
	for _, g := range m.Devices() {
		for _, d := range g.MIG.Devices {
			out = append(out, d.UUID)
		}
	}
	return out
}

func TestMIGRunCreatesAndDestroysItsDevice(t *testing.T) {
	l, m := newLocalMIG(t)
	ctx := context.Background()
	before := migUUIDs(m)
	a, err := l.Acquire(ctx, ask(t, "small", "alice", Ask{GPUs: 1, MIGProfile: "1g.20gb"}), nil)
	require.NoError(t, err)
	require.Len(t, a.Devices, 1)
	d := a.Devices[0]
	require.NotNil(t, d.MIG, "a placement that did not exist: created for the allocation")
	assert.True(t, strings.HasPrefix(d.UUID, "MIG-"), d.UUID)
	assert.Contains(t, migUUIDs(m), d.UUID, "the instance exists on the GPU")
	assert.NotContains(t, before, d.UUID)
	assert.Contains(t, Env(a), "CUDA_VISIBLE_DEVICES="+d.UUID)
	require.NoError(t, l.Release(ctx, "small", "alice"))
	assert.NotContains(t, migUUIDs(m), d.UUID, "destroyed when the allocation ends")
	assert.ElementsMatch(t, before, migUUIDs(m))
}

// A gpudra local killed between recording a MIG device and finishing its
// creation leaves a placement: the next command rolls it back by
// placement and grants the request again.
func TestMIGKilledMidCreationIsRolledBackByPlacement(t *testing.T) {
	l, m := newLocalMIG(t)
	ctx := context.Background()
	r := ask(t, "half", "alice", Ask{GPUs: 1, MIGProfile: "1g.20gb"})
	a, err := l.cfg.Machine.plan(ctx, r, nil, nil)
	require.NoError(t, err)
	pl := a.Devices[0].MIG
	require.NotNil(t, pl)
	// The GPU instance was made, then the kill: the state records the
	// placement without a UUID, and the request still waits.
	made, err := m.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: pl.ParentUUID, Profile: pl.Profile, Start: pl.Start})
	require.NoError(t, err)
	require.NoError(t, saveState(l.cfg.StateDir, &State{Allocations: []Allocation{a}, Waiters: []Waiter{{Request: r, QueuedAt: time.Now()}}}))

	s, err := l.State(ctx)
	require.NoError(t, err)
	assert.NotContains(t, migUUIDs(m), made.UUID, "the half-made instance is gone")
	require.Len(t, s.Allocations, 1, "the request is granted again")
	again := s.Allocations[0]
	assert.NotEmpty(t, again.Devices[0].UUID)
	assert.Contains(t, migUUIDs(m), again.Devices[0].UUID)
	assert.Empty(t, s.Waiters)
}
