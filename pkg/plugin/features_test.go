package plugin

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	gpuapi "github.com/gpudra/gpudra/api/gpu/v1alpha1"
	"github.com/gpudra/gpudra/pkg/features"
	"github.com/gpudra/gpudra/pkg/nvdevice"
)

func TestClaimFeatures(t *testing.T) {
	full := PlannedDevice{Device: "gpu-0"}
	newMig := PlannedDevice{Device: "gpu-0-mig-1g-10gb-6", Mig: &PlannedMig{Profile: "1g.10gb"}}
	existingMig := PlannedDevice{Device: "gpu-0-mig-1g-10gb-6", Mig: &PlannedMig{Profile: "1g.10gb", Existing: &nvdevice.MigDevice{}}}
	mps := &gpuapi.Sharing{Strategy: gpuapi.MPS}
	timeSliced := &gpuapi.Sharing{Strategy: gpuapi.TimeSlicing}
	tests := []struct {
		name    string
		gates   string
		sharing *gpuapi.Sharing
		plan    []PlannedDevice
		want    string // "": allowed
	}{
		{name: "defaults allow MPS, time slices and new MIG devices", sharing: mps, plan: []PlannedDevice{newMig}},
		{name: "defaults allow time slices", sharing: timeSliced, plan: []PlannedDevice{full}},
		{name: "MPS off", gates: "MPSSharing=false", sharing: mps, plan: []PlannedDevice{full},
			want: "sharing.strategy MPS (also the cap of a GPU share): feature gate MPSSharing is disabled (--feature-gates=MPSSharing=true turns it on)"},
		{name: "MPS off, time slices allowed", gates: "MPSSharing=false", sharing: timeSliced, plan: []PlannedDevice{full}},
		{name: "time slices off", gates: "TimeSlicing=false", sharing: timeSliced, plan: []PlannedDevice{full},
			want: "sharing.strategy TimeSlicing: feature gate TimeSlicing is disabled"},
		{name: "exclusive needs no gate", gates: "MPSSharing=false,TimeSlicing=false", sharing: &gpuapi.Sharing{Strategy: gpuapi.Exclusive}, plan: []PlannedDevice{full}},
		{name: "dynamic MIG off", gates: "DynamicMIG=false", plan: []PlannedDevice{full, newMig},
			want: "device gpu-0-mig-1g-10gb-6 needs a MIG instance created: feature gate DynamicMIG is disabled"},
		{name: "dynamic MIG off, an existing MIG device is served", gates: "DynamicMIG=false", plan: []PlannedDevice{existingMig}},
		{name: "every refusal at once", gates: "MPSSharing=false,DynamicMIG=false", sharing: mps, plan: []PlannedDevice{newMig},
			want: "feature gate MPSSharing is disabled (--feature-gates=MPSSharing=true turns it on)\ndevice gpu-0-mig-1g-10gb-6 needs a MIG instance created: feature gate DynamicMIG is disabled"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			gates := features.New()
			require.NoError(t, gates.Set(tc.gates))
			err := claimFeatures(gates, tc.sharing, tc.plan)
			if tc.want == "" {
				assert.NoError(t, err)
				return
			}
			require.Error(t, err)
			assert.Contains(t, err.Error(), tc.want)
		})
	}
}

func TestConfigCheckFeatures(t *testing.T) {
	tests := []struct {
		gates      string
		fractional bool
		want       string
	}{
		{gates: "", fractional: true},
		{gates: "FractionalGPUs=false,MPSSharing=false", fractional: false},
		{gates: "FractionalGPUs=false", fractional: true, want: "fractional GPUs (--fractional-gpus): feature gate FractionalGPUs is disabled"},
		{gates: "MPSSharing=false", fractional: true, want: "fractional GPUs (--fractional-gpus): feature gate MPSSharing is disabled"},
	}
	for _, tc := range tests {
		gates := features.New()
		require.NoError(t, gates.Set(tc.gates))
		err := Config{FractionalGPUs: tc.fractional, FeatureGates: gates}.CheckFeatures()
		if tc.want == "" {
			assert.NoError(t, err, tc.gates)
			continue
		}
		assert.ErrorContains(t, err, tc.want, tc.gates)
	}
	// No gates: the defaults.
	assert.NoError(t, Config{FractionalGPUs: true}.CheckFeatures())
}

// Prepare refuses, through the node state, what a gate that is off forbids,
// before any side effect; a claim prepared before the gate was turned off is
// unprepared as usual.
func TestPrepareRefusesWhatGatesForbid(t *testing.T) {
	e := newEnv(t)
	s := e.start()
	ctx := context.Background()
	before, err := prep(s, claim("before", []string{"gpu-2"}, mpsConfig))
	require.NoError(t, err)
	require.Contains(t, e.daemonPIDs(), serverOf(before))

	gates := features.New()
	require.NoError(t, gates.Set("MPSSharing=false,TimeSlicing=false,DynamicMIG=false"))
	s = e.start()
	s.opts.FeatureGates = gates
	specs := e.cdiSpecs()
	for _, tc := range []struct {
		uid, device, config, want string
	}{
		{"mps", "gpu-3", mpsConfig, "claim ns/claim-mps: sharing.strategy MPS (also the cap of a GPU share): feature gate MPSSharing is disabled"},
		{"ts", "gpu-4", timeSliced, "claim ns/claim-ts: sharing.strategy TimeSlicing: feature gate TimeSlicing is disabled"},
		{"mig", "gpu-0-mig-3g-40gb-4", "", "claim ns/claim-mig: device gpu-0-mig-3g-40gb-4 needs a MIG instance created: feature gate DynamicMIG is disabled"},
	} {
		var configs []string
		if tc.config != "" {
			configs = append(configs, tc.config)
		}
		_, err := prep(s, claim(tc.uid, []string{tc.device}, configs...))
		require.Error(t, err, tc.uid)
		assert.Contains(t, err.Error(), tc.want)
		_, ok := preparedOf(t, s, tc.uid)
		assert.False(t, ok, "%s is not recorded", tc.uid)
	}
	assert.Equal(t, specs, e.cdiSpecs(), "no CDI spec written")
	assert.Empty(t, e.migDevices(), "no MIG device created")
	assert.Len(t, e.daemonPIDs(), 1, "no MPS server started")

	_, err = prep(s, claim("plain", []string{"gpu-5"}))
	require.NoError(t, err, "an exclusive whole GPU needs no gate")
	again, err := prep(s, claim("before", []string{"gpu-2"}, mpsConfig))
	require.NoError(t, err, "a claim prepared before is prepared")
	assert.Equal(t, before, again)
	_, err = s.Unprepare(ctx, "before")
	require.NoError(t, err)
	assert.Empty(t, e.daemonPIDs(), "its MPS server is stopped as usual")
}

// With DeviceHealth off the plugin watches nothing: a GPU's critical XID
// taints nothing. With it on (the default) the same XID taints the GPU.
func TestDeviceHealthGate(t *testing.T) {
	for _, on := range []bool{true, false} {
		t.Run(fmt.Sprintf("DeviceHealth=%t", on), func(t *testing.T) {
			e := newEnv(t)
			ctx, cancel := context.WithCancelCause(context.Background())
			defer cancel(nil)
			sockets, err := os.MkdirTemp("", "gpudra")
			require.NoError(t, err)
			t.Cleanup(func() { os.RemoveAll(sockets) })
			gates := features.New()
			require.NoError(t, gates.Set(fmt.Sprintf("DeviceHealth=%t", on)))
			client := fakeClient(&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: pool, UID: "node-uid"}})
			p, err := Start(ctx, Config{NodeName: pool, Backend: e.machine, Client: client, RegistrarDir: filepath.Join(sockets, "reg"),
				PluginDataDir: filepath.Join(sockets, "data"), CDIDir: e.cdiDir, BootID: "boot-1", FeatureGates: gates}, cancel)
			require.NoError(t, err)
			defer p.Stop()
			inv, err := e.machine.Inventory(ctx)
			require.NoError(t, err)
			require.NoError(t, e.machine.InjectXID(inv.GPUs[2].UUID, "", 79)) // fallen off the bus

			tainted := func() bool {
				slices, err := client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
				require.NoError(t, err)
				for _, s := range slices.Items {
					for _, d := range s.Spec.Devices {
						if len(d.Taints) > 0 {
							return true
						}
					}
				}
				return false
			}
			if on {
				assert.Eventually(t, tainted, 10*time.Second, 20*time.Millisecond)
				return
			}
			assert.Never(t, tainted, time.Second, 50*time.Millisecond)
		})
	}
}
