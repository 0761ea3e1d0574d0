package deviceplugin

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestParseConfig(t *testing.T) {
	tests := []struct {
		name    string
		yaml    string
		want    *Config
		wantErr []string // substrings, each must be in the error
	}{
		{name: "minimal", yaml: "version: v1\n", want: &Config{Version: "v1"}},
		{name: "time-slicing as NVIDIA writes it", yaml: `
version: v1
flags:
  migStrategy: mixed
sharing:
  timeSlicing:
    renameByDefault: false
    failRequestsGreaterThanOne: true
    resources:
    - name: nvidia.com/gpu
      replicas: 4
    - name: mig-1g.10gb
      rename: nvidia.com/mig-small.shared
      replicas: 2
      devices: [1, "MIG-abc"]
`, want: &Config{Version: "v1", Flags: Flags{MigStrategy: "mixed"}, Sharing: Sharing{TimeSlicing: &ReplicatedResources{
			FailRequestsGreaterThanOne: true,
			Resources: []ReplicatedResource{
				{Name: "nvidia.com/gpu", Replicas: 4},
				{Name: "mig-1g.10gb", Rename: "nvidia.com/mig-small.shared", Replicas: 2, Devices: ReplicatedDevices{List: []string{"1", "MIG-abc"}}},
			}}}}},
		{name: "mps", yaml: `
version: v1
sharing:
  mps:
    resources:
    - {name: nvidia.com/gpu, replicas: 2, devices: all}
`, want: &Config{Version: "v1", Sharing: Sharing{MPS: &ReplicatedResources{Resources: []ReplicatedResource{
			{Name: "nvidia.com/gpu", Replicas: 2, Devices: ReplicatedDevices{All: true}}}}}}},
		{name: "missing version", yaml: "sharing: {}\n", wantErr: []string{"version", `must be "v1"`}},
		{name: "wrong version", yaml: "version: v2\n", wantErr: []string{"version", `"v2"`}},
		{name: "unknown top-level field", yaml: "version: v1\nresources: {gpus: []}\n", wantErr: []string{`unknown field "resources"`}},
		{name: "unknown nested field", yaml: "version: v1\nsharing:\n  timeSlicing:\n    resources: [{name: gpu, replicas: 2, replica: 3}]\n",
			wantErr: []string{`unknown field "replica"`}},
		{name: "replicas too small", yaml: "version: v1\nsharing:\n  timeSlicing:\n    resources: [{name: gpu, replicas: 1}]\n",
			wantErr: []string{"sharing.timeSlicing.resources[0].replicas", "at least 2"}},
		{name: "replicas wrong type", yaml: "version: v1\nsharing:\n  timeSlicing:\n    resources: [{name: gpu, replicas: many}]\n",
			wantErr: []string{"replicas"}},
		{name: "no name", yaml: "version: v1\nsharing:\n  mps:\n    resources: [{replicas: 2}]\n",
			wantErr: []string{"sharing.mps.resources[0].name", "required"}},
		{name: "bad name", yaml: "version: v1\nsharing:\n  timeSlicing:\n    resources: [{name: \"Nvidia.com/GPU/x\", replicas: 2}]\n",
			wantErr: []string{"sharing.timeSlicing.resources[0].name", "not a valid extended resource name"}},
		{name: "bad rename", yaml: "version: v1\nsharing:\n  timeSlicing:\n    resources: [{name: gpu, rename: \"kubernetes.io/gpu\", replicas: 2}]\n",
			wantErr: []string{"sharing.timeSlicing.resources[0].rename", "reserved"}},
		{name: "twice in one mechanism", yaml: "version: v1\nsharing:\n  timeSlicing:\n    resources: [{name: gpu, replicas: 2}, {name: nvidia.com/gpu, replicas: 3}]\n",
			wantErr: []string{"sharing.timeSlicing.resources[1].name", "already replicated by sharing.timeSlicing.resources[0]"}},
		{name: "time-slicing and MPS on one resource", yaml: "version: v1\nsharing:\n  timeSlicing:\n    resources: [{name: gpu, replicas: 2}]\n  mps:\n    resources: [{name: gpu, replicas: 2}]\n",
			wantErr: []string{"sharing.mps.resources[0].name", "already replicated by sharing.timeSlicing.resources[0]"}},
		{name: "MPS on MIG", yaml: "version: v1\nsharing:\n  mps:\n    resources: [{name: mig-1g.10gb, replicas: 2}]\n",
			wantErr: []string{"sharing.mps.resources[0].name", "MPS cannot share MIG devices"}},
		{name: "two renames to one name", yaml: "version: v1\nsharing:\n  timeSlicing:\n    resources: [{name: mig-1g.10gb, rename: shared, replicas: 2}, {name: mig-2g.20gb, rename: shared, replicas: 2}]\n",
			wantErr: []string{"sharing.timeSlicing.resources[1].rename", "nvidia.com/shared is already advertised"}},
		{name: "empty resources", yaml: "version: v1\nsharing:\n  timeSlicing:\n    resources: []\n",
			wantErr: []string{"sharing.timeSlicing.resources", "at least one"}},
		{name: "devices not all", yaml: "version: v1\nsharing:\n  timeSlicing:\n    resources: [{name: gpu, replicas: 2, devices: some}]\n",
			wantErr: []string{"devices", `"some"`}},
		{name: "devices bad entry", yaml: "version: v1\nsharing:\n  timeSlicing:\n    resources: [{name: gpu, replicas: 2, devices: [0, {a: b}]}]\n",
			wantErr: []string{"devices[1]"}},
		{name: "single MIG strategy", yaml: "version: v1\nflags: {migStrategy: single}\n",
			want: &Config{Version: "v1", Flags: Flags{MigStrategy: "single"}}},
		{name: "unknown MIG strategy", yaml: "version: v1\nflags: {migStrategy: all}\n",
			wantErr: []string{"flags.migStrategy", `must be "none", "single" or "mixed", got "all"`}},
		{name: "NVIDIA's README config, verbatim", yaml: `
version: v1
flags:
  migStrategy: "none"
  failOnInitError: true
  nvidiaDriverRoot: "/"
  plugin:
    passDeviceSpecs: false
    deviceListStrategy: envvar
    deviceIDStrategy: uuid
`, want: &Config{Version: "v1", Flags: Flags{MigStrategy: "none", FailOnInitError: ptrTo(true), NvidiaDriverRoot: "/",
			Plugin: &PluginFlags{PassDeviceSpecs: ptrTo(false), DeviceListStrategy: DeviceListStrategies{"envvar"}, DeviceIDStrategy: "uuid"}}}},
		{name: "device list strategies as a list", yaml: "version: v1\nflags:\n  plugin:\n    deviceListStrategy: [cdi-annotations, cdi-cri]\n    cdiAnnotationPrefix: nvidia.cdi.k8s.io/\n",
			want: &Config{Version: "v1", Flags: Flags{Plugin: &PluginFlags{DeviceListStrategy: DeviceListStrategies{"cdi-annotations", "cdi-cri"},
				CDIAnnotationPrefix: "nvidia.cdi.k8s.io/"}}}},
		{name: "device list strategies comma-separated, as NVIDIA's flag", yaml: "version: v1\nflags: {plugin: {deviceListStrategy: \"envvar,cdi-cri\"}}\n",
			want: &Config{Version: "v1", Flags: Flags{Plugin: &PluginFlags{DeviceListStrategy: DeviceListStrategies{"envvar", "cdi-cri"}}}}},
		{name: "unknown device list strategy", yaml: "version: v1\nflags: {plugin: {deviceListStrategy: [envvar, cdi]}}\n",
			wantErr: []string{"flags.plugin.deviceListStrategy[1]", `got "cdi"`, "envvar, volume-mounts, cdi-annotations, cdi-cri"}},
		{name: "no device list strategy", yaml: "version: v1\nflags: {plugin: {deviceListStrategy: []}}\n",
			wantErr: []string{"flags.plugin.deviceListStrategy", "at least one"}},
		{name: "device list strategy of a wrong type", yaml: "version: v1\nflags: {plugin: {deviceListStrategy: {a: b}}}\n",
			wantErr: []string{"deviceListStrategy: must be a strategy or a list"}},
		{name: "unknown device ID strategy", yaml: "version: v1\nflags: {plugin: {deviceIDStrategy: serial}}\n",
			wantErr: []string{"flags.plugin.deviceIDStrategy", `"uuid" or "index", got "serial"`}},
		{name: "failOnInitError false", yaml: "version: v1\nflags: {failOnInitError: false}\n",
			wantErr: []string{"flags.failOnInitError: false is not supported"}},
		{name: "relative dev root", yaml: "version: v1\nflags: {nvidiaDevRoot: run/nvidia/driver}\n",
			wantErr: []string{"flags.nvidiaDevRoot: must be an absolute path"}},
		{name: "NVIDIA flag we do not take", yaml: "version: v1\nflags: {gdsEnabled: true}\n",
			wantErr: []string{`unknown field "gdsEnabled"`}},
		{name: "NVIDIA plugin flag we do not take", yaml: "version: v1\nflags: {plugin: {containerDriverRoot: /driver-root}}\n",
			wantErr: []string{`unknown field "containerDriverRoot"`}},
		{name: "several errors at once", yaml: "version: v3\nsharing:\n  timeSlicing:\n    resources: [{name: gpu, replicas: 0}]\n",
			wantErr: []string{"version", "sharing.timeSlicing.resources[0].replicas"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseConfig([]byte(tc.yaml))
			if len(tc.wantErr) > 0 {
				require.Error(t, err)
				for _, s := range tc.wantErr {
					assert.Contains(t, err.Error(), s)
				}
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want, got)
		})
	}
}

func ptrTo[T any](v T) *T { return &v }
