package deviceplugin

import (
	"context"
	"fmt"
	"strings"
	"testing"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
)

// The CDI-free answer gives a container what the CDI names give it: the
// same device nodes (path, type, major, minor), the same cgroup rules, the
// same mounts and variables. Each case allocates with [envvar, cdi-cri], so
// that one answer carries both, and builds three OCI specs:
//
//   - cdiPath: the CDI names resolved by the real CDI library (a CDI
//     runtime given a cdi-cri answer: NVIDIA_VISIBLE_DEVICES=void, then CDI);
//   - cdiFree: DeviceSpecs, Mounts and Envs as the kubelet and containerd
//     turn them into a spec on a runtime without CDI (runtimeSpec);
//   - both: cdiFree, then the CDI names injected (a CDI runtime given both).
//
// cdiFree must equal cdiPath but for NVIDIA_VISIBLE_DEVICES, which the
// envvar strategy sets to the device list as NVIDIA's plugin does; both must
// equal cdiPath exactly: nothing doubled, CDI's values win.
func TestCDIFreeViewMatchesCDI(t *testing.T) {
	type alloc struct {
		resource string
		ids      func(inv *nvdevice.Inventory) []string
	}
	gpu := func(i int) func(*nvdevice.Inventory) []string {
		return func(inv *nvdevice.Inventory) []string { return []string{inv.GPUs[i].UUID} }
	}
	mig := func(refs ...[2]int) func(*nvdevice.Inventory) []string {
		return func(inv *nvdevice.Inventory) []string {
			var out []string
			for _, r := range refs {
				out = append(out, inv.GPUs[r[0]].MIG.Devices[r[1]].UUID)
			}
			return out
		}
	}
	builtinMachine := func(name string) func(t *testing.T) (*sim.Machine, *nvdevice.Inventory) {
		return func(t *testing.T) (*sim.Machine, *nvdevice.Inventory) { return builtin(t, name) }
	}
	tests := []struct {
		name    string
		machine func(t *testing.T) (*sim.Machine, *nvdevice.Inventory)
		flags   string // under flags:, beside the strategies
		sharing string
		allocs  []alloc
		mps     bool
		devRoot string
		// wantNodes are device nodes the container must have, beside the
		// control nodes; wantVisible is NVIDIA_VISIBLE_DEVICES on the
		// CDI-free path.
		wantNodes   func(inv *nvdevice.Inventory) []string
		wantVisible func(inv *nvdevice.Inventory) string
		// wantCaps counts the MIG capability nodes (two per MIG device).
		wantCaps int
	}{
		{name: "whole GPU", machine: builtinMachine("dgx-h100-nomig"), flags: "migStrategy: none",
			allocs:      []alloc{{"nvidia.com/gpu", gpu(3)}},
			wantNodes:   func(*nvdevice.Inventory) []string { return []string{"/dev/nvidia3"} },
			wantVisible: func(inv *nvdevice.Inventory) string { return inv.GPUs[3].UUID }},
		{name: "whole GPU, device nodes under a driver container's root", machine: builtinMachine("dgx-h100-nomig"),
			flags: "migStrategy: none\n  nvidiaDriverRoot: /run/nvidia/driver", devRoot: "/run/nvidia/driver",
			allocs:      []alloc{{"nvidia.com/gpu", gpu(5)}},
			wantNodes:   func(*nvdevice.Inventory) []string { return []string{"/dev/nvidia5"} },
			wantVisible: func(inv *nvdevice.Inventory) string { return inv.GPUs[5].UUID }},
		{name: "GPU in MIG mode, whole under none", machine: builtinMachine("dgx-h100"), flags: "migStrategy: none",
			allocs:      []alloc{{"nvidia.com/gpu", gpu(2)}},
			wantNodes:   func(*nvdevice.Inventory) []string { return []string{"/dev/nvidia2"} },
			wantVisible: func(inv *nvdevice.Inventory) string { return inv.GPUs[2].UUID }},
		{name: "MIG device, mixed", machine: migMachine, flags: "migStrategy: mixed", wantCaps: 2,
			allocs:      []alloc{{"nvidia.com/mig-1g.10gb", mig([2]int{1, 1})}},
			wantNodes:   func(*nvdevice.Inventory) []string { return []string{"/dev/nvidia1"} },
			wantVisible: func(inv *nvdevice.Inventory) string { return inv.GPUs[1].MIG.Devices[1].UUID }},
		{name: "two MIG devices, single", machine: uniformMig, flags: "migStrategy: single", wantCaps: 4,
			allocs:    []alloc{{"nvidia.com/gpu", mig([2]int{0, 1}, [2]int{1, 0})}},
			wantNodes: func(*nvdevice.Inventory) []string { return []string{"/dev/nvidia0", "/dev/nvidia1"} },
			wantVisible: func(inv *nvdevice.Inventory) string {
				return inv.GPUs[0].MIG.Devices[1].UUID + "," + inv.GPUs[1].MIG.Devices[0].UUID
			}},
		{name: "time-slicing replicas of one GPU", machine: builtinMachine("dgx-h100-nomig"), flags: "migStrategy: none",
			sharing: "  timeSlicing:\n    resources: [{name: nvidia.com/gpu, replicas: 4}]",
			allocs: []alloc{{"nvidia.com/gpu", func(inv *nvdevice.Inventory) []string {
				return []string{inv.GPUs[6].UUID + "::1", inv.GPUs[6].UUID + "::3"}
			}}},
			wantNodes:   func(*nvdevice.Inventory) []string { return []string{"/dev/nvidia6"} },
			wantVisible: func(inv *nvdevice.Inventory) string { return inv.GPUs[6].UUID }},
		{name: "MPS replica", machine: builtinMachine("dgx-h100-nomig"), flags: "migStrategy: none", mps: true,
			sharing: "  mps:\n    resources: [{name: nvidia.com/gpu, replicas: 2, devices: [0]}]",
			allocs: []alloc{{"nvidia.com/gpu", func(inv *nvdevice.Inventory) []string {
				return []string{inv.GPUs[0].UUID + "::1"}
			}}},
			wantNodes:   func(*nvdevice.Inventory) []string { return []string{"/dev/nvidia0"} },
			wantVisible: func(inv *nvdevice.Inventory) string { return inv.GPUs[0].UUID }},
		{name: "two resources in one container", machine: migMachine, flags: "migStrategy: mixed", wantCaps: 2,
			allocs:    []alloc{{"nvidia.com/gpu", gpu(0)}, {"nvidia.com/mig-3g.40gb", mig([2]int{1, 2})}},
			wantNodes: func(*nvdevice.Inventory) []string { return []string{"/dev/nvidia0", "/dev/nvidia1"} },
			// The kubelet keeps the first resource's value, as with
			// NVIDIA's plugin.
			wantVisible: func(inv *nvdevice.Inventory) string { return inv.GPUs[0].UUID }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m, inv := tc.machine(t)
			cfg := mustConfig(t, fmt.Sprintf("version: v1\nflags:\n  %s\n  plugin:\n    deviceListStrategy: [envvar, cdi-cri]\nsharing:\n%s\n", tc.flags, tc.sharing))
			rs, err := Resources(inv, ResourceOptions{Config: cfg})
			require.NoError(t, err)
			dir := specDir(t, m, inv)
			driver := writeDriverSpec(t, m, dir, "")
			if tc.mps {
				writeMPSSpec(t, m, inv, dir, "gpu-0")
			}
			var resps []*pluginapi.ContainerAllocateResponse
			var names []string
			for _, a := range tc.allocs {
				p, err := New(Options{Resource: resourceNamed(t, rs, a.resource), CDIDir: dir, ExtraCDIDevices: driver, MPS: tc.mps})
				require.NoError(t, err)
				out, err := p.Allocate(context.Background(), &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: a.ids(inv)}}})
				require.NoError(t, err)
				r := out.ContainerResponses[0]
				for _, d := range r.Devices {
					assert.True(t, strings.HasPrefix(d.HostPath, tc.devRoot+"/dev/"), "host path %s under the dev root", d.HostPath)
				}
				for _, n := range r.CdiDevices {
					names = append(names, n.Name)
				}
				resps = append(resps, r)
			}

			cdiPath := &oci.Spec{Process: &oci.Process{Env: []string{VisibleDevicesEnv + "=void"}}, Linux: &oci.Linux{}}
			injectCDI(t, dir, cdiPath, names)
			var noCDI []*pluginapi.ContainerAllocateResponse
			for _, r := range resps {
				noCDI = append(noCDI, &pluginapi.ContainerAllocateResponse{Envs: r.Envs, Mounts: r.Mounts, Devices: r.Devices, Annotations: r.Annotations})
			}
			cdiFree := runtimeSpec(t, noCDI, hostNode(tc.devRoot))
			both := runtimeSpec(t, resps, hostNode(tc.devRoot))
			injectCDI(t, dir, both, names)

			want := viewOf(t, cdiPath)
			for _, n := range append(tc.wantNodes(inv), "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools") {
				assert.Contains(t, want.Devices, n)
			}
			caps := 0
			for p := range want.Devices {
				if strings.HasPrefix(p, "/dev/nvidia-caps/") {
					caps++
				}
			}
			assert.Equal(t, tc.wantCaps, caps, "MIG capability nodes")
			assert.NotEmpty(t, want.Mounts, "the driver's files")
			got := viewOf(t, cdiFree)
			assert.Equal(t, tc.wantVisible(inv), got.Env[VisibleDevicesEnv], "envvar: NVIDIA's device list")
			assert.Equal(t, "void", want.Env[VisibleDevicesEnv])
			got.Env[VisibleDevicesEnv] = "void"
			assert.Equal(t, want, got, "the CDI-free view is the CDI view")
			assert.Equal(t, want, viewOf(t, both), "a CDI runtime given both: nothing doubled, CDI's values win")
			assert.Len(t, both.Linux.Devices, len(cdiPath.Linux.Devices))
			assert.Len(t, both.Mounts, len(cdiPath.Mounts))
		})
	}
}

// Hooks (the driver spec with --nvidia-cdi-hook) have no place in the
// device plugin API: the plugin counts them (and logs it when it runs);
// the rest of the CDI edits still go.
func TestCDIFreeViewWithoutHooks(t *testing.T) {
	m, inv := builtin(t, "dgx-h100-nomig")
	rs, err := Resources(inv, ResourceOptions{})
	require.NoError(t, err)
	dir := specDir(t, m, inv)
	driver := writeDriverSpec(t, m, dir, "/usr/bin/nvidia-cdi-hook")
	p, err := New(Options{Resource: rs[0], CDIDir: dir, ExtraCDIDevices: driver})
	require.NoError(t, err)
	assert.Equal(t, 3, p.hooks, "create-symlinks, enable-cuda-compat, update-ldcache")
	out, err := p.Allocate(context.Background(), &pluginapi.AllocateRequest{ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: []string{inv.GPUs[0].UUID}}}})
	require.NoError(t, err)
	r := out.ContainerResponses[0]
	assert.NotEmpty(t, r.Mounts)
	assert.Equal(t, "/usr/lib/x86_64-linux-gnu", r.Envs["NVIDIA_CTK_LIBCUDA_DIR"], "the driver spec's variables go")
}

// A CDI directory that lacks a device's spec fails New, naming the device,
// rather than a container's start.
func TestNewRefusesUnresolvedCDI(t *testing.T) {
	_, inv := builtin(t, "dgx-h100-nomig")
	rs, err := Resources(inv, ResourceOptions{})
	require.NoError(t, err)
	_, err = New(Options{Resource: rs[0], CDIDir: t.TempDir()})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "unresolvable CDI devices "+CDIDeviceName("gpu-0"))
	_, err = New(Options{Resource: rs[0]})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "no CDI directory")
	cri, err := Resources(inv, ResourceOptions{Config: mustConfig(t, "version: v1\nflags: {plugin: {deviceListStrategy: cdi-cri}}\n")})
	require.NoError(t, err)
	_, err = New(Options{Resource: cri[0]})
	assert.NoError(t, err, "CDI names only: nothing to resolve")
}
