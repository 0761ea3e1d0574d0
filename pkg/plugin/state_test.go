package plugin

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/prepared"
	"github.com/gpudra/gpudra/pkg/sharing"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

const pool = "node-a"

type env struct {
	t       testing.TB
	machine *sim.Machine
	dir     string
	cdiDir  string
	crashAt func(string)
	// claims answers a rebuild's API list; onRebuild sees its report.
	claims    ClaimLister
	onRebuild func(RebuildReport)
	// onPreparedClaims is the state's hook for the prepared claims gauge.
	onPreparedClaims func(int)
	// backend, when set, stands for the machine as the state's backend.
	backend nvdevice.Interface
	// bootID is the node's boot ("boot-1" if empty): a test changes it for
	// a reboot.
	bootID string
}

// testMachine is a DGX H100 with MIG mode on GPUs 0 and 1 only: MIG
// placements there, plain whole GPUs on 2 to 7.
const testMachine = "name: dgx-h100-mig01\ngpuModel: h100-sxm5\ngpuCount: 8\nnvlink: nvswitch\nmigEnabled: [0, 1]\n"

func newEnv(t testing.TB) *env { return newEnvOf(t, testMachine) }

// newEnvOf is newEnv over another machine spec (YAML).
func newEnvOf(t testing.TB, machine string) *env {
	spec, err := sim.ParseSpec([]byte(machine))
	require.NoError(t, err)
	m, err := sim.New(spec, pool)
	require.NoError(t, err)
	dir := t.TempDir()
	return &env{t: t, machine: m, dir: dir, cdiDir: filepath.Join(dir, "cdi")}
}

// start is a plugin (re)start over the same node: same GPUs, same files.
func (e *env) start() *NodeState {
	e.t.Helper()
	w, err := cdi.NewWriter(e.cdiDir)
	require.NoError(e.t, err)
	standIn, err := filepath.Abs("../../hack/fake-nvidia-cuda-mps-control")
	require.NoError(e.t, err)
	// The simulator's host facts, as Start takes them from the backend.
	host, err := e.machine.Host(context.Background())
	require.NoError(e.t, err)
	sharer, err := sharing.NewManager(sharing.Options{Root: filepath.Join(e.dir, "sharing"), Policy: host.ComputePolicy,
		MPSControl: sharing.ExecMPSControl{Path: standIn}})
	require.NoError(e.t, err)
	boot := e.bootID
	if boot == "" {
		boot = "boot-1"
	}
	s, err := NewNodeState(context.Background(), StateOptions{
		Pool: pool, Backend: e.backendOrMachine(), CDI: w, Majors: host.Majors, CapMinors: host.CapMinors,
		CheckpointPath: filepath.Join(e.dir, "checkpoint.json"), BootID: boot, CrashAt: e.crashAt,
		Sharing: sharer, Claims: e.claims, OnPreparedClaims: e.onPreparedClaims,
		OnRebuild: func(_ context.Context, r RebuildReport) {
			if e.onRebuild != nil {
				e.onRebuild(r)
			}
		},
	})
	require.NoError(e.t, err)
	return s
}

// prep prepares a claim and returns its devices.
func prep(s *NodeState, c *resourceapi.ResourceClaim) ([]prepared.Device, error) {
	rec, err := s.Prepare(context.Background(), c)
	return rec.Devices, err
}

// preparedOf returns a claim's devices if it is prepared.
func preparedOf(t testing.TB, s *NodeState, uid string) ([]prepared.Device, bool) {
	t.Helper()
	rec, ok, err := s.Record(context.Background(), uid)
	require.NoError(t, err)
	return rec.Devices, ok
}

func managedOf(t testing.TB, s *NodeState) map[string]bool {
	t.Helper()
	m, err := s.ManagedMigDevices(context.Background())
	require.NoError(t, err)
	return m
}

func (e *env) migDevices() []nvdevice.MigDevice {
	inv, err := e.machine.Inventory(context.Background())
	require.NoError(e.t, err)
	var out []nvdevice.MigDevice
	for _, g := range inv.GPUs {
		out = append(out, g.MIG.Devices...)
	}
	return out
}

func (e *env) cdiSpecs() []string {
	entries, _ := os.ReadDir(e.cdiDir)
	var out []string
	for _, en := range entries {
		out = append(out, en.Name())
	}
	return out
}

func claim(uid string, devices []string, configs ...string) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "claim-" + uid, Namespace: "ns", UID: types.UID(uid)},
		Status:     resourceapi.ResourceClaimStatus{Allocation: &resourceapi.AllocationResult{}},
	}
	for _, d := range devices {
		c.Status.Allocation.Devices.Results = append(c.Status.Allocation.Devices.Results,
			resourceapi.DeviceRequestAllocationResult{Request: "gpu", Driver: slicebuilder.DriverName, Pool: pool, Device: d})
	}
	for _, raw := range configs {
		c.Status.Allocation.Devices.Config = append(c.Status.Allocation.Devices.Config, resourceapi.DeviceAllocationConfiguration{
			Source: resourceapi.AllocationConfigSourceClaim,
			DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{
				Driver: slicebuilder.DriverName, Parameters: runtime.RawExtension{Raw: []byte(raw)}}},
		})
	}
	return c
}

func inject(t testing.TB, dir string, ids []string) *oci.Spec {
	t.Helper()
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(dir), cdiapi.WithAutoRefresh(false))
	require.NoError(t, err)
	spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
	_, err = cache.InjectDevices(spec, ids...)
	require.NoError(t, err)
	return spec
}

func TestPrepareFullGPU(t *testing.T) {
	e := newEnv(t)
	s := e.start()
	inv, _ := e.machine.Inventory(context.Background())
	devs, err := prep(s, claim("u1", []string{"gpu-3"}))
	require.NoError(t, err)
	require.Len(t, devs, 1)
	assert.Equal(t, inv.GPUs[3].UUID, devs[0].UUID)

	spec := inject(t, e.cdiDir, devs[0].CDIDeviceIDs)
	assert.Contains(t, spec.Process.Env, "NVIDIA_VISIBLE_DEVICES=void")
	assert.Contains(t, spec.Process.Env, cdi.DeviceUUIDEnv(cdi.DeviceName("u1", "gpu-3"))+"="+inv.GPUs[3].UUID)
	var paths []string
	for _, d := range spec.Linux.Devices {
		paths = append(paths, d.Path)
	}
	assert.ElementsMatch(t, []string{"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidia3"}, paths)

	again, err := prep(s, claim("u1", []string{"gpu-3"}))
	require.NoError(t, err)
	assert.Equal(t, devs, again, "prepare is idempotent")

	destroyed, err := s.Unprepare(context.Background(), "u1")
	require.NoError(t, err)
	assert.False(t, destroyed, "a full GPU changes no published device")
	assert.Empty(t, e.cdiSpecs())
	_, err = s.Unprepare(context.Background(), "u1")
	require.NoError(t, err, "unprepare of an unknown claim succeeds")
}

func TestPrepareMigCreatesAndUnprepareDestroys(t *testing.T) {
	e := newEnv(t)
	s := e.start()
	devs, err := prep(s, claim("u1", []string{"gpu-0-mig-3g-40gb-4"}))
	require.NoError(t, err)
	migs := e.migDevices()
	require.Len(t, migs, 1)
	assert.Equal(t, migs[0].UUID, devs[0].UUID)
	assert.Equal(t, nvdevice.Placement{Start: 4, Size: 4}, migs[0].Placement)
	assert.Equal(t, map[string]bool{migs[0].UUID: true}, managedOf(t, s))

	spec := inject(t, e.cdiDir, devs[0].CDIDeviceIDs)
	gi := migs[0].GPUInstanceID
	var caps []string
	for _, d := range spec.Linux.Devices {
		if strings.HasPrefix(d.Path, "/dev/nvidia-caps/") {
			caps = append(caps, d.Path)
		}
	}
	assert.Equal(t, []string{fmt.Sprintf("/dev/nvidia-caps/nvidia-cap%d", 3+gi*9), fmt.Sprintf("/dev/nvidia-caps/nvidia-cap%d", 4+gi*9)}, caps)

	destroyed, err := s.Unprepare(context.Background(), "u1")
	require.NoError(t, err)
	assert.True(t, destroyed)
	assert.Empty(t, e.migDevices(), "the MIG device the driver created is destroyed")
}

// TestPrepareFollowsTheMachineBetweenPrepares: a prepare reads the node's
// devices without a copy (the backend's snapshot, with the device index
// built from it kept while it is the same); a change between two prepares,
// by the driver or outside it, is still what the next prepare plans with.
func TestPrepareFollowsTheMachineBetweenPrepares(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	s := e.start()
	inv, err := e.machine.Inventory(ctx)
	require.NoError(t, err)
	_, err = prep(s, claim("u1", []string{"gpu-0-mig-3g-40gb-4"}))
	require.NoError(t, err)
	_, err = s.Unprepare(ctx, "u1")
	require.NoError(t, err)
	require.Empty(t, e.migDevices())

	// Made outside the driver: the next prepare takes it as it is.
	outside, err := e.machine.CreateMigDevice(ctx, nvdevice.MigCreateRequest{ParentUUID: inv.GPUs[0].UUID, Profile: "3g.40gb", Start: 4})
	require.NoError(t, err)
	devs, err := prep(s, claim("u2", []string{"gpu-0-mig-3g-40gb-4"}))
	require.NoError(t, err)
	assert.Equal(t, outside.UUID, devs[0].UUID, "the instance that is there, not a new one")
	assert.Nil(t, devs[0].CreatedMig)

	require.NoError(t, e.machine.LoseGPU(inv.GPUs[3].UUID))
	_, err = prep(s, claim("u3", []string{"gpu-3"}))
	require.EqualError(t, err, "device gpu-3 of claim ns/claim-u3 does not exist on this node (a GPU may have vanished)")
	require.NoError(t, e.machine.RecoverGPU(inv.GPUs[3].UUID))
	devs, err = prep(s, claim("u3", []string{"gpu-3"}))
	require.NoError(t, err)
	assert.Equal(t, inv.GPUs[3].UUID, devs[0].UUID)
}

func (e *env) backendOrMachine() nvdevice.Interface {
	if e.backend != nil {
		return e.backend
	}
	return e.machine
}

// staleSnapshot is a backend whose inventory snapshot is older than the
// machine (as the NVML backend's may be, up to its TTL).
type staleSnapshot struct {
	*sim.Machine
	snap *nvdevice.Inventory
}

func (b staleSnapshot) InventorySnapshot(context.Context) (*nvdevice.Inventory, error) {
	return b.snap, nil
}

// TestPrepareReadsTheGPUsAgainForADeviceItsSnapshotLacks: a backend's
// snapshot may be older than a device (taken while a GPU was off the bus,
// up to the NVML backend's TTL): a prepare whose device it lacks reads the
// GPUs again before it fails, and takes the device as it is now.
func TestPrepareReadsTheGPUsAgainForADeviceItsSnapshotLacks(t *testing.T) {
	ctx := context.Background()
	e := newEnv(t)
	inv, err := e.machine.Inventory(ctx)
	require.NoError(t, err)
	require.NoError(t, e.machine.LoseGPU(inv.GPUs[3].UUID))
	old, err := e.machine.Inventory(ctx)
	require.NoError(t, err)
	require.NoError(t, e.machine.RecoverGPU(inv.GPUs[3].UUID))
	e.backend = staleSnapshot{Machine: e.machine, snap: old}
	s := e.start()
	devs, err := prep(s, claim("u1", []string{"gpu-3"}))
	require.NoError(t, err, "gpu-3 is back, though not in the snapshot")
	assert.Equal(t, inv.GPUs[3].UUID, devs[0].UUID)
	_, err = prep(s, claim("u2", []string{"gpu-9"}))
	require.EqualError(t, err, "device gpu-9 of claim ns/claim-u2 does not exist on this node (a GPU may have vanished)", "a device that is nowhere still fails")
}

func TestDoubleUseRefused(t *testing.T) {
	e := newEnv(t)
	s := e.start()
	_, err := prep(s, claim("u1", []string{"gpu-0"}))
	require.NoError(t, err)
	for _, dev := range []string{"gpu-0", "gpu-0-mig-1g-10gb-6"} {
		_, err = prep(s, claim("u2", []string{dev}))
		require.EqualError(t, err, fmt.Sprintf("device %s is unavailable: gpu-0 is prepared for claim ns/claim-u1 (u1)", dev))
	}
	_, err = prep(s, claim("u3", []string{"gpu-1-mig-3g-40gb-0"}))
	require.NoError(t, err)
	_, err = prep(s, claim("u4", []string{"gpu-1-mig-1g-10gb-2"}))
	require.ErrorContains(t, err, "device gpu-1-mig-1g-10gb-2 is unavailable: gpu-1-mig-3g-40gb-0 is prepared for claim ns/claim-u3")
	_, err = prep(s, claim("u5", []string{"gpu-1-mig-3g-40gb-4"}))
	require.NoError(t, err, "a placement that does not overlap is fine")
	assert.Len(t, e.migDevices(), 3, "the whole GPU 0 (in MIG mode, served as 7g.80gb) and the two 3g.40gb")
}

func TestBadInput(t *testing.T) {
	e := newEnv(t)
	s := e.start()
	_, err := prep(s, claim("u1", []string{"gpu-0"}, `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"mode":"x"}}`))
	require.EqualError(t, err, `claim ns/claim-u1: config 0 for request "gpu": decode GpuConfig: unknown field "sharing.mode"`)
	_, err = prep(s, claim("u2", []string{"gpu-9"}))
	require.EqualError(t, err, "device gpu-9 of claim ns/claim-u2 does not exist on this node (a GPU may have vanished)")
	assert.Empty(t, e.cdiSpecs(), "a refused claim leaves nothing")
}

// TestCrashAtEveryStep kills the plugin at every step of prepare and of
// unprepare, restarts it over the same node, and checks that nothing leaks
// and nothing prepared is lost.
func TestCrashAtEveryStep(t *testing.T) {
	prepareSteps := []string{"after-intent", "before-mig-marker", "before-mig-create", "after-mig-create", "after-mig-record", "after-cdi-write", "after-complete"}
	unprepareSteps := []string{"after-mig-delete", "after-cdi-remove"}
	for _, step := range append(prepareSteps, unprepareSteps...) {
		t.Run(step, func(t *testing.T) {
			e := newEnv(t)
			other := e.start()
			keep, err := prep(other, claim("keep", []string{"gpu-1-mig-1g-10gb-0"}))
			require.NoError(t, err)

			e.crashAt = func(s string) {
				if s == step {
					panic("killed at " + s)
				}
			}
			s := e.start()
			isPrepare := false
			for _, p := range prepareSteps {
				isPrepare = isPrepare || p == step
			}
			func() {
				defer func() { require.Equal(t, "killed at "+step, recover()) }()
				if isPrepare {
					_, _ = prep(s, claim("u1", []string{"gpu-0-mig-3g-40gb-4"}))
				} else {
					e.crashAt = nil
					s2 := e.start()
					_, err := prep(s2, claim("u1", []string{"gpu-0-mig-3g-40gb-4"}))
					require.NoError(t, err)
					e.crashAt = func(s string) {
						if s == step {
							panic("killed at " + s)
						}
					}
					_, _ = e.start().Unprepare(context.Background(), "u1")
				}
			}()

			e.crashAt = nil
			restarted := e.start()
			got, ok := preparedOf(t, restarted, "keep")
			require.True(t, ok, "the other claim survives")
			assert.Equal(t, keep, got)
			if step == "after-complete" {
				_, ok := preparedOf(t, restarted, "u1")
				assert.True(t, ok, "a completed prepare is kept")
				_, err := restarted.Unprepare(context.Background(), "u1")
				require.NoError(t, err)
			} else if !isPrepare {
				// An interrupted unprepare is finished by the kubelet's retry.
				_, err := restarted.Unprepare(context.Background(), "u1")
				require.NoError(t, err)
			}
			migs := e.migDevices()
			require.Len(t, migs, 1, "only the other claim's MIG device remains")
			assert.Equal(t, keep[0].UUID, migs[0].UUID)
			assert.Len(t, e.cdiSpecs(), 1, "only the other claim's CDI spec remains")

			devs, err := prep(restarted, claim("u1", []string{"gpu-0-mig-3g-40gb-4"}))
			require.NoError(t, err, "the claim can be prepared after the restart")
			assert.Len(t, devs, 1)
		})
	}
}

// TestYAMLSpecsOfTheVersionBeforeAreCleanedUp: claim specs are JSON now;
// a node upgraded from a version that wrote them as YAML keeps those, and
// they go the same ways: a prepared claim's at its unprepare, one that no
// record names at the start.
func TestYAMLSpecsOfTheVersionBeforeAreCleanedUp(t *testing.T) {
	e := newEnv(t)
	s := e.start()
	for uid, gpu := range map[string]string{"u1": "gpu-1", "u2": "gpu-2"} {
		_, err := prep(s, claim(uid, []string{gpu}))
		require.NoError(t, err)
	}
	require.ElementsMatch(t, []string{cdi.SpecName("u1") + ".json", cdi.SpecName("u2") + ".json"}, e.cdiSpecs())
	// The same specs as the version before wrote them: YAML.
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(e.cdiDir), cdiapi.WithAutoRefresh(false))
	require.NoError(t, err)
	yamlOf := map[string]func(){}
	for _, uid := range []string{"u1", "u2"} {
		json := filepath.Join(e.cdiDir, cdi.SpecName(uid)+".json")
		spec, err := cdiapi.ReadSpec(json, 0)
		require.NoError(t, err)
		require.NoError(t, os.Remove(json))
		yamlOf[uid] = func() { require.NoError(t, cache.WriteSpec(spec.Spec, cdi.SpecName(uid)+".yaml")) }
		yamlOf[uid]()
	}

	_, err = s.Unprepare(context.Background(), "u2")
	require.NoError(t, err)
	assert.Equal(t, []string{cdi.SpecName("u1") + ".yaml"}, e.cdiSpecs(), "u2's spec is removed at its unprepare")
	yamlOf["u2"]() // left again, as by a kill of the version before
	restarted := e.start()
	assert.Equal(t, []string{cdi.SpecName("u1") + ".yaml"}, e.cdiSpecs(), "u2's spec, which no record names, is removed at the start")
	_, err = restarted.Unprepare(context.Background(), "u1")
	require.NoError(t, err)
	assert.Empty(t, e.cdiSpecs())
}

// TestCrashFullGPUAfterCDIWrite: a full-GPU prepare keeps no intent record;
// the CDI spec a kill leaves behind is removed at the next start. The
// completed record, written and synced beside the checkpoint while the spec
// was written, was staged, not renamed: the start removes it too, and the
// claim is not prepared.
func TestCrashFullGPUAfterCDIWrite(t *testing.T) {
	e := newEnv(t)
	e.crashAt = func(s string) {
		if s == "after-cdi-write" {
			panic(s)
		}
	}
	s := e.start()
	func() {
		defer func() { require.Equal(t, "after-cdi-write", recover()) }()
		_, _ = prep(s, claim("u1", []string{"gpu-2"}))
	}()
	require.Len(t, e.cdiSpecs(), 1)
	require.Len(t, e.stagedCheckpoints(), 1, "the completed record was staged, not renamed")
	e.crashAt = nil
	restarted := e.start()
	assert.Empty(t, e.cdiSpecs(), "the orphan spec is removed at start")
	assert.Empty(t, e.stagedCheckpoints(), "the staged record is removed at start")
	_, ok := preparedOf(t, restarted, "u1")
	assert.False(t, ok, "the staged record never became the checkpoint")
	_, err := prep(restarted, claim("u1", []string{"gpu-2"}))
	require.NoError(t, err)
	_, ok = preparedOf(t, restarted, "u1")
	assert.True(t, ok)
	assert.Empty(t, e.stagedCheckpoints())
}

// A whole GPU in MIG mode is useless to CUDA as /dev/nvidia<N> alone: it is
// served as the instance that spans it, created at prepare and destroyed at
// unprepare.
func TestPrepareWholeGPUInMIGMode(t *testing.T) {
	e := newEnv(t)
	s := e.start()
	devs, err := prep(s, claim("u1", []string{"gpu-0"}))
	require.NoError(t, err)
	require.Len(t, devs, 1)
	migs := e.migDevices()
	require.Len(t, migs, 1)
	assert.Equal(t, "7g.80gb", migs[0].Profile)
	assert.Equal(t, nvdevice.Placement{Start: 0, Size: 8}, migs[0].Placement)
	assert.Equal(t, migs[0].UUID, devs[0].UUID, "the container sees the instance")
	assert.Equal(t, "gpu-0", devs[0].Device, "still the device the scheduler allocated")
	spec := inject(t, e.cdiDir, devs[0].CDIDeviceIDs)
	assert.Contains(t, spec.Process.Env, cdi.DeviceUUIDEnv(cdi.DeviceName("u1", "gpu-0"))+"="+migs[0].UUID)
	assert.Len(t, spec.Linux.Devices, 6, "control nodes, the GPU and two capability nodes")

	destroyed, err := s.Unprepare(context.Background(), "u1")
	require.NoError(t, err)
	assert.True(t, destroyed)
	assert.Empty(t, e.migDevices())
}
