package plugin

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// Config.HealthIgnoredXIDs decides which XIDs taint: nil keeps the default
// (application XIDs ignored, 48 and 79 taint), a list replaces it.
func TestHealthIgnoredXIDs(t *testing.T) {
	for _, tc := range []struct {
		name    string
		ignored []uint64
		xid     uint64
		taint   string // "" : gpu-2 stays untainted
		// recovers: the backend, which ignores the XID by default, was
		// told of it and reports the GPU recovered after the quiet period.
		recovers bool
	}{
		{name: "default: XID 48 taints", xid: 48, taint: "xid-48"},
		{name: "default: XID 79 taints", xid: 79, taint: "xid-79"},
		{name: "default: application XID 13 does not", xid: 13},
		{name: "an XID made ignorable does not taint", ignored: []uint64{13, 48}, xid: 48},
		{name: "an XID left out of the list still taints", ignored: []uint64{48}, xid: 79, taint: "xid-79"},
		{name: "a list replaces the default: XID 13 taints", ignored: []uint64{48}, xid: 13, taint: "xid-13", recovers: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			e.machine.SetRecoveryQuietPeriod(time.Second)
			d := &Driver{state: e.start(), backend: e.machine, pool: pool, xidPolicy: nvdevice.NewXIDPolicy(tc.ignored)}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			require.NoError(t, d.watchHealth(ctx))
			inv := inventory(t, e.machine)
			require.NoError(t, e.machine.InjectXID(inv.GPUs[2].UUID, "", tc.xid))
			// Events are handled in order: once the lost GPU is seen,
			// the XID before it was handled too.
			marker := inv.GPUs[5].UUID
			require.NoError(t, e.machine.LoseGPU(marker))
			require.Eventually(t, func() bool { _, ok := d.unhealthy()[marker]; return ok }, 5*time.Second, 10*time.Millisecond)

			taints := taintsOf(t, d)
			if tc.taint == "" {
				assert.Empty(t, taints)
				return
			}
			assert.Equal(t, map[string]string{"gpu-2": tc.taint}, taints)
			if tc.recovers {
				require.Eventually(t, func() bool { return len(taintsOf(t, d)) == 0 }, 5*time.Second, 20*time.Millisecond,
					"the GPU recovers: the backend checks what the policy made unhealthy")
			}
		})
	}
}

// An entry of the health file that the policy now ignores (the admin
// changed it since) taints nothing after a restart.
func TestHealthFileFollowsThePolicy(t *testing.T) {
	for _, tc := range []struct {
		name    string
		ignored []uint64
		want    int
	}{
		{name: "default", want: 1},
		{name: "XID 48 made ignorable", ignored: []uint64{48}, want: 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			ev := nvdevice.HealthEvent{Kind: nvdevice.HealthXID, GPUUUID: "GPU-a", XID: 48}
			require.NoError(t, (&healthStore{path: dir + "/" + HealthFile, bootID: "boot-1"}).save(map[string]nvdevice.HealthEvent{"GPU-a": ev}))
			d := &Driver{xidPolicy: nvdevice.NewXIDPolicy(tc.ignored)}
			d.restoreHealth(context.Background(), dir+"/"+HealthFile, "boot-1")
			assert.Len(t, d.unhealthy(), tc.want)
		})
	}
}
