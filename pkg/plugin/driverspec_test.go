package plugin

import (
	"context"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"

	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
)

// withDriverRoot gives e's machine a fake driver root of the version.
func withDriverRoot(t *testing.T, e *env, version string) string {
	t.Helper()
	root := filepath.Join(e.dir, "driver")
	require.NoError(t, sim.WriteDriverRoot(root, version))
	e.machine.SetDriverRoot(root)
	return root
}

// TestPrepareReferencesTheDriverSpec: every prepared device's CDI ids
// include the common driver device, and the runtime's injection of them
// gives the device nodes and the driver's files, read-only from the driver
// root.
func TestPrepareReferencesTheDriverSpec(t *testing.T) {
	e := newEnv(t)
	root := withDriverRoot(t, e, "570.172.08")
	c := claim("uid-1", []string{"gpu-2"})
	kubelet, _ := startPlugin(t, e, c)
	req := &drapb.NodePrepareResourcesRequest{Claims: []*drapb.Claim{{Namespace: c.Namespace, Name: c.Name, Uid: string(c.UID)}}}
	resp, err := kubelet.dra.NodePrepareResources(context.Background(), req)
	require.NoError(t, err)
	require.Empty(t, resp.Claims["uid-1"].Error)
	require.Len(t, resp.Claims["uid-1"].Devices, 1)
	ids := resp.Claims["uid-1"].Devices[0].CdiDeviceIds
	assert.Equal(t, []string{"gpu.gpudra.dev/claim=uid-1-gpu-2", cdi.DriverDeviceID}, ids)

	spec := inject(t, e.cdiDir, ids)
	var nodes []string
	for _, d := range spec.Linux.Devices {
		nodes = append(nodes, d.Path)
	}
	assert.Contains(t, nodes, "/dev/nvidia2")
	mounts := map[string]string{}
	for _, m := range spec.Mounts {
		if strings.HasPrefix(m.Source, root+"/") {
			mounts[m.Destination] = m.Source
			assert.Contains(t, m.Options, "ro", m.Destination)
		}
	}
	for _, p := range []string{"/usr/lib/x86_64-linux-gnu/libcuda.so.570.172.08", "/usr/lib/x86_64-linux-gnu/libcuda.so.1",
		"/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.570.172.08", "/usr/lib/x86_64-linux-gnu/libnvidia-ptxjitcompiler.so.570.172.08",
		"/usr/lib/x86_64-linux-gnu/libnvidia-nvvm.so.570.172.08", "/usr/lib/x86_64-linux-gnu/libnvidia-gpucomp.so.570.172.08",
		"/usr/bin/nvidia-smi", "/usr/bin/nvidia-cuda-mps-control", "/usr/bin/nvidia-cuda-mps-server",
		"/run/nvidia-persistenced/socket"} {
		assert.Contains(t, mounts, p)
	}

	// Unprepare removes the claim's spec; the driver's stays for the next.
	un, err := kubelet.dra.NodeUnprepareResources(context.Background(), &drapb.NodeUnprepareResourcesRequest{Claims: req.Claims})
	require.NoError(t, err)
	assert.Empty(t, un.Claims["uid-1"].Error)
	assert.Equal(t, []string{cdi.DriverSpecName + ".yaml"}, e.cdiSpecs())
}

// TestDriverSpecFollowsTheDriver: a driver upgrade under the running
// plugin rewrites the common spec; an unchanged driver writes nothing.
func TestDriverSpecFollowsTheDriver(t *testing.T) {
	e := newEnv(t)
	w, err := cdi.NewWriter(e.cdiDir)
	require.NoError(t, err)
	ds := &driverSpec{backend: e.machine, writer: w}
	ctx := context.Background()

	wrote, err := ds.sync(ctx)
	require.NoError(t, err, "no driver root is no error")
	assert.False(t, wrote)
	assert.Equal(t, []string{"a"}, ds.deviceIDs([]string{"a"}), "no common spec: devices do not reference one")

	withDriverRoot(t, e, "570.172.08")
	wrote, err = ds.sync(ctx)
	require.NoError(t, err)
	assert.True(t, wrote)
	assert.Equal(t, []string{"a", cdi.DriverDeviceID}, ds.deviceIDs([]string{"a"}))
	wrote, err = ds.sync(ctx)
	require.NoError(t, err)
	assert.False(t, wrote, "the same driver: nothing to write")
	has := func(version string) bool {
		spec := inject(t, e.cdiDir, []string{cdi.DriverDeviceID})
		for _, m := range spec.Mounts {
			if m.Destination == "/usr/lib/x86_64-linux-gnu/libcuda.so."+version {
				return true
			}
		}
		return false
	}
	assert.True(t, has("570.172.08"))

	withDriverRoot(t, e, "580.65.06")
	ds.refresh(ctx)
	assert.True(t, has("580.65.06"), "the upgraded driver's files")
	assert.False(t, has("570.172.08"), "none of the old driver's")
}
