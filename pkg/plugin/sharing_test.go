package plugin

import (
	"context"
	"encoding/json"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/types"

	"github.com/gpudra/gpudra/pkg/prepared"
	"github.com/gpudra/gpudra/pkg/sharing"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

const (
	mpsConfig  = `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mps":{"pinnedMemoryLimit":"40Gi"}}}`
	timeSliced = `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"TimeSlicing","timeSlicing":{"interval":"Long"},"ipc":true}}`
)

// daemonPIDs are the stand-in MPS daemons running for the node, by the
// devices (comma-separated UUIDs) of their server.
func (e *env) daemonPIDs() map[string]int {
	out := map[string]int{}
	root := sharing.MPSRoot(filepath.Join(e.dir, "sharing"))
	entries, _ := os.ReadDir(root)
	for _, d := range entries {
		pid, err := sharing.RecordedDaemonPID(filepath.Join(root, d.Name()))
		if err != nil {
			continue
		}
		var devs []string
		if b, err := os.ReadFile(filepath.Join(root, d.Name(), "server.json")); err == nil {
			_ = json.Unmarshal(b, &devs)
		}
		if (sharing.ExecMPSControl{}).Alive(pid) {
			out[strings.Join(devs, ",")] = pid
		}
	}
	return out
}

// serverOf is the key daemonPIDs uses for the server of prepared devices.
func serverOf(devs []prepared.Device) string {
	var uuids []string
	for _, d := range devs {
		uuids = append(uuids, d.UUID)
	}
	return strings.Join(sharing.MPSServerFor("/", uuids).Devices, ",")
}

func TestPrepareMPSAndTimeSlicing(t *testing.T) {
	e := newEnv(t)
	s := e.start()
	ctx := context.Background()
	inv, err := e.machine.Inventory(ctx)
	require.NoError(t, err)

	devs, err := prep(s, claim("mps", []string{"gpu-2", "gpu-3"}, mpsConfig))
	require.NoError(t, err)
	spec := inject(t, e.cdiDir, append(devs[0].CDIDeviceIDs, devs[1].CDIDeviceIDs...))
	assert.Contains(t, spec.Process.Env, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=40960M,1=40960M")
	assert.Contains(t, spec.Process.Env, "CUDA_MPS_PIPE_DIRECTORY="+sharing.MPSPipeDirectory)
	require.Len(t, spec.Mounts, 1)
	assert.Equal(t, sharing.MPSPipeDirectory, spec.Mounts[0].Destination)
	mps := serverOf(devs)
	assert.Contains(t, e.daemonPIDs(), mps)

	_, err = prep(s, claim("ts", []string{"gpu-4"}, timeSliced))
	require.NoError(t, err)
	assert.Equal(t, 3, e.machine.TimeSlice(inv.GPUs[4].UUID))

	// A restart keeps the daemon: same pid, still one.
	pid := e.daemonPIDs()[mps]
	s = e.start()
	assert.Equal(t, map[string]int{mps: pid}, e.daemonPIDs())

	_, err = s.Unprepare(ctx, "mps")
	require.NoError(t, err)
	assert.Empty(t, e.daemonPIDs())
	_, err = s.Unprepare(ctx, "ts")
	require.NoError(t, err)
	assert.Equal(t, 0, e.machine.TimeSlice(inv.GPUs[4].UUID), "restored with the last claim")
}

func TestSharingConfigRefused(t *testing.T) {
	e := newEnv(t)
	s := e.start()
	c := claim("u1", []string{"gpu-6"}, `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mps":{"pinnedMemoryLimit":"96Gi"}}}`)
	_, err := prep(s, c)
	require.Error(t, err)
	assert.Contains(t, err.Error(), `claim ns/claim-u1: request gpu: invalid GpuConfig: sharing.mps.pinnedMemoryLimit: Invalid value: "96Gi": exceeds the memory of device gpu-6 (81559Mi)`)
	assert.Empty(t, e.cdiSpecs())
	assert.Empty(t, e.daemonPIDs())
}

// Shares of one fractional GPU may be prepared for several claims; a whole
// allocation of that GPU may not.
func TestSharesOfOneGPU(t *testing.T) {
	e := newEnv(t)
	s := e.start()
	share := func(uid, mem string) *resourceapi.ResourceClaim {
		c := claim(uid, []string{"gpu-5"})
		id := types.UID("share-" + uid)
		c.Status.Allocation.Devices.Results[0].ShareID = &id
		c.Status.Allocation.Devices.Results[0].ConsumedCapacity = map[resourceapi.QualifiedName]resource.Quantity{
			slicebuilder.CapacityMemory: resource.MustParse(mem), slicebuilder.CapacityMultiprocessors: resource.MustParse("33")}
		return c
	}
	a, err := prep(s, share("a", "20Gi"))
	require.NoError(t, err)
	_, err = prep(s, share("b", "40Gi"))
	require.NoError(t, err)
	spec := inject(t, e.cdiDir, a[0].CDIDeviceIDs)
	assert.Contains(t, spec.Process.Env, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=20480M", "a share is capped with MPS at its size")
	assert.Contains(t, spec.Process.Env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25")
	assert.Equal(t, []string{serverOf(a)}, slices.Collect(maps.Keys(e.daemonPIDs())), "one MPS server for the GPU's shares")

	_, err = prep(s, claim("whole", []string{"gpu-5"}))
	require.Error(t, err)
	assert.Contains(t, err.Error(), "device gpu-5 is unavailable")
}

// TestCrashWithSharing kills the plugin at every sharing step of prepare and
// unprepare: no daemon, time slice or spec is left behind, none is lost.
func TestCrashWithSharing(t *testing.T) {
	prepareSteps := []string{"after-intent", "before-sharing", "after-sharing", "after-cdi-write", "after-complete"}
	unprepareSteps := []string{"after-sharing-undo", "after-cdi-remove"}
	for _, step := range append(prepareSteps, unprepareSteps...) {
		t.Run(step, func(t *testing.T) {
			e := newEnv(t)
			ctx := context.Background()
			devs, err := prep(e.start(), claim("keep", []string{"gpu-1"}, mpsConfig))
			require.NoError(t, err)
			keep := serverOf(devs)
			keepPID := e.daemonPIDs()[keep]
			require.NotZero(t, keepPID)

			kill := func(s string) {
				if s == step {
					panic("killed at " + s)
				}
			}
			isPrepare := strings.HasPrefix(step, "after-intent") || step == "before-sharing" || step == "after-sharing" ||
				step == "after-cdi-write" || step == "after-complete"
			func() {
				defer func() { require.Equal(t, "killed at "+step, recover()) }()
				if isPrepare {
					e.crashAt = kill
					_, _ = prep(e.start(), claim("u1", []string{"gpu-0"}, mpsConfig))
					return
				}
				_, err := prep(e.start(), claim("u1", []string{"gpu-0"}, mpsConfig))
				require.NoError(t, err)
				e.crashAt = kill
				_, _ = e.start().Unprepare(ctx, "u1")
			}()

			e.crashAt = nil
			restarted := e.start()
			if step == "after-complete" {
				_, ok := preparedOf(t, restarted, "u1")
				assert.True(t, ok)
			}
			_, err = restarted.Unprepare(ctx, "u1")
			require.NoError(t, err)
			assert.Equal(t, map[string]int{keep: keepPID}, e.daemonPIDs(), "the other claim's daemon is untouched, u1's is gone")
			assert.Len(t, e.cdiSpecs(), 1)
			devs, err = prep(restarted, claim("u1", []string{"gpu-0"}, mpsConfig))
			require.NoError(t, err, "the claim can be prepared after the restart")
			assert.Contains(t, e.daemonPIDs(), serverOf(devs))
			assert.Len(t, e.daemonPIDs(), 2)
			_, err = restarted.Unprepare(ctx, "u1")
			require.NoError(t, err)
			_, err = restarted.Unprepare(ctx, "keep")
			require.NoError(t, err)
			assert.Empty(t, e.daemonPIDs())
		})
	}
}
