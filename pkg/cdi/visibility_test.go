package cdi

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"testing"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/prepared"
)

// permutations lists every order of ids.
func permutations(ids []string) [][]string {
	if len(ids) <= 1 {
		return [][]string{slices.Clone(ids)}
	}
	var out [][]string
	for i := range ids {
		rest := slices.Concat(ids[:i:i], ids[i+1:])
		for _, p := range permutations(rest) {
			out = append(out, append([]string{ids[i]}, p...))
		}
	}
	return out
}

// view is what a container gets, in a form that does not depend on order:
// sorted device nodes (path type major:minor), sorted env, sorted mounts.
type view struct {
	Nodes, Env, Mounts []string
}

func viewOf(s *oci.Spec) view {
	var v view
	for _, d := range s.Linux.Devices {
		v.Nodes = append(v.Nodes, fmt.Sprintf("%s %s %d:%d", d.Path, d.Type, d.Major, d.Minor))
	}
	v.Env = slices.Clone(s.Process.Env)
	for _, m := range s.Mounts {
		v.Mounts = append(v.Mounts, m.Source+":"+m.Destination)
	}
	sort.Strings(v.Nodes)
	sort.Strings(v.Env)
	sort.Strings(v.Mounts)
	return v
}

// visibilityClaims are three claims, as a container with several claims
// gets them: two devices of one claim (a whole GPU and a MIG device), a
// whole GPU of a claim with sharing settings (IPC), and a MIG device on the
// same parent as the first claim's.
func visibilityClaims() []Claim {
	return []Claim{
		claimA(),
		{UID: "uid-b", Devices: []prepared.Device{{Device: "gpu-5", UUID: "GPU-bbb5", Nodes: []prepared.DeviceNode{GPUNode(majors, 5)}}},
			Env:    map[string]string{"GPUDRA_IPC_DIR": "/ipc"},
			Mounts: []Mount{{HostPath: "/var/lib/gpudra/ipc/uid-b", ContainerPath: "/ipc"}}},
		{UID: "uid-c", Devices: []prepared.Device{{Device: "gpu-0-mig-1g-10gb-0", UUID: "MIG-ccc", Nodes: []prepared.DeviceNode{GPUNode(majors, 0), CapNode(majors, 12), CapNode(majors, 13)}}}},
	}
}

func writeClaims(t *testing.T, claims []Claim) (string, []string) {
	t.Helper()
	dir := t.TempDir()
	w, err := NewWriter(dir)
	require.NoError(t, err)
	var ids []string
	for _, c := range claims {
		spec, err := BuildSpec(c, majors)
		require.NoError(t, err)
		require.NoError(t, w.Write(c.UID, spec))
		for _, d := range c.Devices {
			ids = append(ids, QualifiedName(c.UID, d.Device))
		}
	}
	return dir, ids
}

// A container with two or three claims sees the union of their devices,
// the same in every order the runtime may apply the claims' edits in.
func TestSeveralClaimsInOneContainerInEveryOrder(t *testing.T) {
	all := visibilityClaims()
	for _, tc := range []struct {
		name   string
		claims []Claim
	}{
		{"two claims", all[:2]},
		{"two claims on one parent GPU", []Claim{all[0], all[2]}},
		{"three claims", all},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir, ids := writeClaims(t, tc.claims)
			// Every device's identity, and every device node it needs.
			wantEnv := []string{"NVIDIA_VISIBLE_DEVICES=void"}
			wantNodes := map[string]bool{}
			for _, n := range ControlNodes(majors) {
				wantNodes[fmt.Sprintf("%s c %d:%d", n.Path, n.Major, n.Minor)] = true
			}
			for _, c := range tc.claims {
				for _, d := range c.Devices {
					wantEnv = append(wantEnv, DeviceUUIDEnv(DeviceName(c.UID, d.Device))+"="+d.UUID)
					for _, n := range d.Nodes {
						wantNodes[fmt.Sprintf("%s c %d:%d", n.Path, n.Major, n.Minor)] = true
					}
				}
				for k, v := range c.Env {
					wantEnv = append(wantEnv, k+"="+v)
				}
			}
			var first *view
			orders := permutations(ids)
			for _, order := range orders {
				got := viewOf(inject(t, dir, order...))
				assert.ElementsMatch(t, wantEnv, got.Env, "order %v", order)
				nodes := map[string]bool{}
				for _, n := range got.Nodes {
					nodes[n] = true
				}
				assert.Equal(t, wantNodes, nodes, "order %v", order)
				for _, e := range got.Env {
					assert.False(t, strings.HasPrefix(e, "CUDA_VISIBLE_DEVICES="), "order %v: %s", order, e)
				}
				if first == nil {
					first = &got
					continue
				}
				assert.Equal(t, *first, got, "order %v resolves as %v does", order, orders[0])
			}
		})
	}
}

// A pod whose one claim has two requests, one per container: each
// container gets its own device node only, env naming only its own GPU,
// and NVIDIA_VISIBLE_DEVICES=void.
func TestTwoRequestClaimOneDevicePerContainer(t *testing.T) {
	c := Claim{UID: "uid-pair", Devices: []prepared.Device{
		{Device: "gpu-1", UUID: "GPU-1111", Nodes: []prepared.DeviceNode{GPUNode(majors, 1)}},
		{Device: "gpu-0-mig-3g-40gb-4", UUID: "MIG-2222", Nodes: []prepared.DeviceNode{GPUNode(majors, 0), CapNode(majors, 30), CapNode(majors, 31)}},
	}}
	dir, ids := writeClaims(t, []Claim{c})
	for i, d := range c.Devices {
		other := c.Devices[1-i]
		got := inject(t, dir, ids[i])
		var paths []string
		for _, n := range got.Linux.Devices {
			paths = append(paths, n.Path)
		}
		want := []string{"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}
		for _, n := range d.Nodes {
			want = append(want, n.Path)
		}
		assert.ElementsMatch(t, want, paths, "container of %s", d.Device)
		assert.ElementsMatch(t, []string{"NVIDIA_VISIBLE_DEVICES=void", DeviceUUIDEnv(DeviceName(c.UID, d.Device)) + "=" + d.UUID}, got.Process.Env,
			"container of %s", d.Device)
		for _, e := range got.Process.Env {
			assert.NotContains(t, e, other.UUID, "container of %s", d.Device)
			assert.NotContains(t, e, DeviceUUIDEnv(DeviceName(c.UID, other.Device)), "container of %s", d.Device)
		}
	}
}

func TestDeviceUUIDEnv(t *testing.T) {
	assert.Equal(t, "GPUDRA_DEVICE_0F3A_9B_GPU_0_MIG_1G_10GB_6_UUID", DeviceUUIDEnv("0f3a-9b-gpu-0-mig-1g-10gb-6"))
	assert.Equal(t, "GPUDRA_DEVICE_A_B_C_UUID", DeviceUUIDEnv("a.b_c"))
}
