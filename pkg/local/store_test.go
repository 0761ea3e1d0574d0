package local

import (
	"context"
	"encoding/json"
	"os"
	"os/user"
	"path/filepath"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// A state.json of before per-user files is read on first use, nothing
// lost: this user's entries move to their own file, another user's stay
// in state.json (only that user may move them), and both still hold
// their GPUs.
func TestLegacyStateIsMigrated(t *testing.T) {
	me, err := user.LookupId(strconv.Itoa(os.Geteuid()))
	if err != nil {
		t.Skipf("this uid has no user name: %v", err)
	}
	l, dir := newLocal(t, "h100-pcie-nvlink")
	ctx := context.Background()
	plan := func(name, user string, held []Allocation) Allocation {
		a, err := l.cfg.Machine.plan(ctx, ask(t, name, user, Ask{GPUs: 1}), held, nil)
		require.NoError(t, err)
		return a
	}
	mine := plan("mine", me.Username, nil)
	theirs := plan("theirs", "someone-else", []Allocation{mine})
	b, err := json.Marshal(State{Allocations: []Allocation{mine, theirs}, Policy: "Priority"})
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(filepath.Join(dir, stateFile), b, 0o664))

	s, err := l.State(ctx)
	require.NoError(t, err)
	require.ElementsMatch(t, []string{"mine", "theirs"}, []string{s.Allocations[0].Name, s.Allocations[1].Name})
	assert.Equal(t, "Priority", s.Policy)

	var own, settings State
	b, err = os.ReadFile(ownFile(dir))
	require.NoError(t, err, "this user's file")
	require.NoError(t, json.Unmarshal(b, &own))
	require.Len(t, own.Allocations, 1)
	assert.Equal(t, "mine", own.Allocations[0].Name)
	b, err = os.ReadFile(filepath.Join(dir, stateFile))
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(b, &settings))
	require.Len(t, settings.Allocations, 1)
	assert.Equal(t, "theirs", settings.Allocations[0].Name)
	assert.Equal(t, "Priority", settings.Policy)

	// The two GPUs stay held: two more of four, not three.
	a, err := l.Acquire(ctx, ask(t, "two", me.Username, Ask{GPUs: 2}), nil)
	require.NoError(t, err)
	for _, d := range a.Devices {
		assert.NotEqual(t, mine.Devices[0].UUID, d.UUID)
		assert.NotEqual(t, theirs.Devices[0].UUID, d.UUID)
	}
}
