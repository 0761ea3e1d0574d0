package plugin

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/plugin/checkpoint"
	"github.com/gpudra/gpudra/pkg/sharing"
)

// These tests put the node state where a real node puts it: two plugin
// instances side by side, a lost or corrupt checkpoint under running pods,
// kills between the two NVML steps of a MIG operation, a GPU that is lost
// while a rollback is pending.

// TestTwoInstancesShareOneState: during a rolling update the kubelet may
// prepare a claim through the old instance and unprepare it through the new
// one. The new one must know the claim and undo everything.
func TestTwoInstancesShareOneState(t *testing.T) {
	e := newEnv(t)
	old := e.start()
	devs, err := prep(old, claim("u1", []string{"gpu-0-mig-3g-40gb-4"}))
	require.NoError(t, err)
	require.Len(t, e.migDevices(), 1)

	updated := e.start()
	got, ok := preparedOf(t, updated, "u1")
	require.True(t, ok, "the new instance sees the old one's claim")
	assert.Equal(t, devs, got)

	// Both keep preparing: neither overwrites the other's records.
	_, err = prep(updated, claim("u2", []string{"gpu-3"}))
	require.NoError(t, err)
	_, err = prep(old, claim("u3", []string{"gpu-4"}))
	require.NoError(t, err)
	for _, s := range []*NodeState{old, updated} {
		for _, uid := range []string{"u1", "u2", "u3"} {
			_, ok := preparedOf(t, s, uid)
			assert.True(t, ok, "claim %s is known to both instances", uid)
		}
	}
	_, err = prep(old, claim("u4", []string{"gpu-3"}))
	require.ErrorContains(t, err, "gpu-3 is prepared for claim ns/claim-u2", "the old instance refuses a device the new one prepared")

	destroyed, err := updated.Unprepare(context.Background(), "u1")
	require.NoError(t, err)
	assert.True(t, destroyed)
	assert.Empty(t, e.migDevices(), "the MIG device is destroyed by the instance that did not create it")
	_, ok = preparedOf(t, old, "u1")
	assert.False(t, ok, "and the old instance knows")
	assert.Len(t, e.cdiSpecs(), 2)
}

// TestSecondInstanceStartsDuringPrepare: the new instance's startup sweep
// must not roll back a prepare the old instance has in flight.
func TestSecondInstanceStartsDuringPrepare(t *testing.T) {
	e := newEnv(t)
	reached, release := make(chan struct{}), make(chan struct{})
	e.crashAt = func(step string) {
		if step == "after-mig-create" {
			close(reached)
			<-release
		}
	}
	old := e.start()
	e.crashAt = nil
	done := make(chan error, 1)
	go func() {
		_, err := prep(old, claim("u1", []string{"gpu-0-mig-3g-40gb-4"}))
		done <- err
	}()
	<-reached

	started := make(chan *NodeState, 1)
	go func() { started <- e.start() }()
	select {
	case <-started:
		t.Fatal("the new instance swept the node while a prepare was in flight")
	case <-time.After(200 * time.Millisecond):
	}
	close(release)
	require.NoError(t, <-done)
	updated := <-started
	got, ok := preparedOf(t, updated, "u1")
	require.True(t, ok, "the in-flight prepare completed and was not rolled back")
	migs := e.migDevices()
	require.Len(t, migs, 1)
	assert.Equal(t, migs[0].UUID, got[0].UUID)
	assert.Len(t, e.cdiSpecs(), 1)
}

// claimsOf serves claims as the API would list them for a rebuild.
func claimsOf(claims ...*resourceapi.ResourceClaim) ClaimLister {
	return func(context.Context) ([]*resourceapi.ResourceClaim, error) { return claims, nil }
}

// TestLostOrCorruptCheckpointIsRebuilt: pods are running on a MIG device
// the driver created, a whole GPU and an MPS claim; the checkpoint is lost
// or damaged. After a restart every claim is still prepared (nothing
// destroyed, the MPS daemon adopted), the report says so, and an unprepare
// still destroys the driver's MIG device.
func TestLostOrCorruptCheckpointIsRebuilt(t *testing.T) {
	for _, damage := range []string{"corrupt", "lost", "truncated"} {
		t.Run(damage, func(t *testing.T) {
			e := newEnv(t)
			s := e.start()
			mig := claim("u-mig", []string{"gpu-0-mig-3g-40gb-4"})
			full := claim("u-full", []string{"gpu-3"})
			mps := claim("u-mps", []string{"gpu-5"}, mpsConfig)
			var mpsServer string
			for _, c := range []*resourceapi.ResourceClaim{mig, full, mps} {
				devs, err := prep(s, c)
				require.NoError(t, err)
				if c == mps {
					mpsServer = serverOf(devs)
				}
			}
			before := map[string]bool{}
			for _, uid := range []string{"u-mig", "u-full", "u-mps"} {
				_, ok := preparedOf(t, s, uid)
				before[uid] = ok
			}
			migsBefore := e.migDevices()
			daemons := e.daemonPIDs()
			require.Contains(t, daemons, mpsServer)

			path := filepath.Join(e.dir, "checkpoint.json")
			switch damage {
			case "corrupt":
				b, err := os.ReadFile(path)
				require.NoError(t, err)
				b[len(b)/2] ^= 0x20
				require.NoError(t, os.WriteFile(path, b, 0o600))
			case "truncated":
				require.NoError(t, os.WriteFile(path, nil, 0o600))
			case "lost":
				require.NoError(t, os.Remove(path))
			}

			var reports []RebuildReport
			e.claims = claimsOf(mig, full, mps)
			e.onRebuild = func(r RebuildReport) { reports = append(reports, r) }
			restarted := e.start()
			require.Len(t, reports, 1, "one rebuild, reported")
			assert.Equal(t, []string{"ns/claim-u-full", "ns/claim-u-mig", "ns/claim-u-mps"}, reports[0].Adopted)
			assert.Contains(t, reports[0].Message(), "nothing running pods use was destroyed")
			if damage == "lost" {
				assert.Empty(t, reports[0].MovedAside)
			} else {
				assert.ErrorIs(t, reports[0].Cause, checkpoint.ErrCorrupt)
			}

			for uid := range before {
				_, ok := preparedOf(t, restarted, uid)
				assert.True(t, ok, "claim %s is prepared after the rebuild", uid)
			}
			assert.Equal(t, migsBefore, e.migDevices(), "no MIG device destroyed or created")
			assert.Len(t, e.cdiSpecs(), 3, "no CDI spec removed")
			assert.Equal(t, daemons[mpsServer], e.daemonPIDs()[mpsServer], "the MPS daemon is adopted, not restarted")
			assert.Equal(t, map[string]bool{migsBefore[0].UUID: true}, managedOf(t, restarted), "the driver's MIG device is its own again")

			// A repeat prepare from the kubelet returns the same devices.
			got, err := prep(restarted, mig)
			require.NoError(t, err)
			assert.Equal(t, migsBefore[0].UUID, got[0].UUID)

			destroyed, err := restarted.Unprepare(context.Background(), "u-mig")
			require.NoError(t, err)
			assert.True(t, destroyed)
			assert.Empty(t, e.migDevices(), "the adopted MIG device is destroyed at unprepare")
		})
	}
}

// TestRebuildWithoutTheAPIRetries: while the API cannot be reached the
// rebuild stores nothing and destroys nothing; the next call rebuilds.
func TestRebuildWithoutTheAPIRetries(t *testing.T) {
	e := newEnv(t)
	s := e.start()
	c := claim("u1", []string{"gpu-1-mig-1g-10gb-0"})
	_, err := prep(s, c)
	require.NoError(t, err)
	require.NoError(t, os.Remove(filepath.Join(e.dir, "checkpoint.json")))
	apiDown := true
	e.claims = func(context.Context) ([]*resourceapi.ResourceClaim, error) {
		if apiDown {
			return nil, errors.New("connection refused")
		}
		return []*resourceapi.ResourceClaim{c}, nil
	}
	restarted := e.start()
	_, _, err = restarted.Record(context.Background(), "u1")
	require.ErrorContains(t, err, "connection refused")
	assert.Len(t, e.migDevices(), 1)
	assert.Len(t, e.cdiSpecs(), 1)
	apiDown = false
	_, ok := preparedOf(t, restarted, "u1")
	assert.True(t, ok)
}

// TestInterruptedMigOperations kills the plugin between the GPU instance
// and the compute instance of a create, and of a destroy, and fails a GPU
// instance destroy: nothing is left behind once the rollback or the
// kubelet's retry ran.
func TestInterruptedMigOperations(t *testing.T) {
	tests := []struct {
		name, step string
		unprepare  bool
	}{
		{"kill between GI and CI create", sim.StepAfterGICreate, false},
		{"kill between CI and GI destroy", sim.StepAfterCIDestroy, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			s := e.start()
			if tc.unprepare {
				_, err := prep(s, claim("u1", []string{"gpu-0-mig-3g-40gb-4"}))
				require.NoError(t, err)
			}
			e.machine.SetStepHook(func(step string) {
				if step == tc.step {
					panic("killed at " + step)
				}
			})
			func() {
				defer func() { require.Equal(t, "killed at "+tc.step, recover()) }()
				if tc.unprepare {
					_, _ = s.Unprepare(context.Background(), "u1")
				} else {
					_, _ = prep(s, claim("u1", []string{"gpu-0-mig-3g-40gb-4"}))
				}
			}()
			e.machine.SetStepHook(nil)
			half := e.migDevices()
			require.Len(t, half, 1)
			assert.Equal(t, -1, half[0].ComputeInstanceID, "a GPU instance without a compute instance is left")

			restarted := e.start()
			if tc.unprepare {
				_, err := restarted.Unprepare(context.Background(), "u1") // the kubelet retries
				require.NoError(t, err)
			}
			assert.Empty(t, e.migDevices(), "the half-made instance is found by placement and destroyed")
			_, err := prep(restarted, claim("u2", []string{"gpu-0-mig-3g-40gb-4"}))
			require.NoError(t, err, "the placement is free again")
		})
	}

	t.Run("failed GPU instance destroy", func(t *testing.T) {
		e := newEnv(t)
		s := e.start()
		_, err := prep(s, claim("u1", []string{"gpu-0-mig-3g-40gb-4"}))
		require.NoError(t, err)
		e.machine.FailNextGIDestroy(nvdevice.ErrInUse)
		_, err = s.Unprepare(context.Background(), "u1")
		require.ErrorIs(t, err, nvdevice.ErrInUse)
		_, ok := preparedOf(t, s, "u1")
		assert.True(t, ok, "the record stays until the GPU instance is gone")
		_, err = s.Unprepare(context.Background(), "u1")
		require.NoError(t, err)
		assert.Empty(t, e.migDevices(), "the retry destroys the GPU instance the first attempt left")
	})
}

// TestFailedStartupRollbackIsRetried: a prepare interrupted on a GPU that is
// then lost cannot be rolled back at start. The plugin starts anyway, the
// record is kept, the rest of the node works, and the rollback is retried.
func TestFailedStartupRollbackIsRetried(t *testing.T) {
	e := newEnv(t)
	e.crashAt = func(step string) {
		if step == "after-mig-create" {
			panic(step)
		}
	}
	s := e.start()
	func() {
		defer func() { require.Equal(t, "after-mig-create", recover()) }()
		_, _ = prep(s, claim("u1", []string{"gpu-0-mig-1g-10gb-6"}))
	}()
	e.crashAt = nil
	inv, err := e.machine.Inventory(context.Background())
	require.NoError(t, err)
	gpu0 := inv.GPUs[0].UUID
	require.NoError(t, e.machine.LoseGPU(gpu0))

	restarted := e.start() // must not fail
	pending, err := restarted.Interrupted(context.Background())
	require.NoError(t, err)
	assert.Equal(t, []string{"u1"}, pending, "the record is kept")
	_, err = prep(restarted, claim("u2", []string{"gpu-1-mig-1g-10gb-6"}))
	require.NoError(t, err, "the rest of the node works")

	restarted.RetryInterrupted(context.Background())
	pending, err = restarted.Interrupted(context.Background())
	require.NoError(t, err)
	assert.Equal(t, []string{"u1"}, pending, "still lost: still kept")

	require.NoError(t, e.machine.RecoverGPU(gpu0))
	restarted.RetryInterrupted(context.Background())
	pending, err = restarted.Interrupted(context.Background())
	require.NoError(t, err)
	assert.Empty(t, pending)
	for _, d := range e.migDevices() {
		assert.NotEqual(t, gpu0, d.ParentUUID, "the interrupted prepare's instance is gone")
	}
}

// TestSupervisionDoesNotReviveAServerTheOtherInstanceStopped: during a
// rolling update the instance that prepared an MPS claim keeps supervising
// servers while the other instance unprepares the claim. Supervision reads
// the claims from the checkpoint under the node lock, so it does not start
// the stopped server again (it did when it ran from the preparing instance's
// memory).
func TestSupervisionDoesNotReviveAServerTheOtherInstanceStopped(t *testing.T) {
	e := newEnv(t)
	old := e.start()
	devs, err := prep(old, claim("m", []string{"gpu-2"}, mpsConfig))
	require.NoError(t, err)
	server := serverOf(devs)
	require.Contains(t, e.daemonPIDs(), server)

	updated := e.start()
	_, err = updated.Unprepare(context.Background(), "m")
	require.NoError(t, err)
	require.Eventually(t, func() bool { return len(e.daemonPIDs()) == 0 }, 5*time.Second, 20*time.Millisecond)

	old.SuperviseSharing(context.Background())
	updated.SuperviseSharing(context.Background())
	time.Sleep(200 * time.Millisecond)
	assert.Empty(t, e.daemonPIDs(), "no instance started the unprepared claim's server again")

	// And a server that died while its claim is prepared is started again
	// by either instance.
	devs, err = prep(updated, claim("n", []string{"gpu-2"}, mpsConfig))
	require.NoError(t, err)
	pid := e.daemonPIDs()[serverOf(devs)]
	require.NotZero(t, pid)
	require.NoError(t, sharing.ExecMPSControl{}.Kill(pid))
	require.Eventually(t, func() bool { return len(e.daemonPIDs()) == 0 }, 5*time.Second, 20*time.Millisecond)
	old.SuperviseSharing(context.Background())
	require.Eventually(t, func() bool { p := e.daemonPIDs()[serverOf(devs)]; return p != 0 && p != pid }, 5*time.Second, 20*time.Millisecond)
	_, err = old.Unprepare(context.Background(), "n")
	require.NoError(t, err)
}
