package cdi

import (
	"context"
	"path/filepath"
	"strings"
	"testing"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
)

// simDriverFiles is what the simulator discovers in a fresh fake driver
// root of driver 570.172.08.
func simDriverFiles(t *testing.T) nvdevice.DriverFiles {
	t.Helper()
	root := t.TempDir()
	require.NoError(t, sim.WriteDriverRoot(root, "570.172.08"))
	m, err := sim.NewBuiltin("dgx-h100", "node-a")
	require.NoError(t, err)
	m.SetDriverRoot(root)
	f, err := m.DriverFiles(context.Background())
	require.NoError(t, err)
	return f
}

// injectIDs resolves CDI ids into an OCI spec, as a container runtime does.
func injectIDs(t *testing.T, dir string, ids ...string) *oci.Spec {
	t.Helper()
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(dir), cdiapi.WithAutoRefresh(false))
	require.NoError(t, err)
	spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
	_, err = cache.InjectDevices(spec, ids...)
	require.NoError(t, err)
	return spec
}

func mountsByDest(s *oci.Spec) map[string]oci.Mount {
	out := map[string]oci.Mount{}
	for _, m := range s.Mounts {
		out[m.Destination] = m
	}
	return out
}

func TestDriverSpecMountsEverythingReadOnly(t *testing.T) {
	f := simDriverFiles(t)
	spec, err := BuildDriverSpec(f, DriverOptions{})
	require.NoError(t, err)
	dir := t.TempDir()
	w, err := NewWriter(dir)
	require.NoError(t, err)
	require.NoError(t, w.WriteDriver(spec))
	uids, err := w.ClaimUIDs()
	require.NoError(t, err)
	assert.Empty(t, uids, "the driver's spec is no claim's: a sweep leaves it alone")

	oci := injectIDs(t, dir, DriverDeviceID)
	mounts := mountsByDest(oci)
	want := []string{"/usr/bin/nvidia-smi", "/usr/bin/nvidia-cuda-mps-control", "/usr/bin/nvidia-cuda-mps-server",
		"/run/nvidia-persistenced/socket", "/lib/firmware/nvidia/570.172.08/gsp_ga10x.bin"}
	for _, l := range sim.DriverLibraries {
		want = append(want, "/usr/lib/x86_64-linux-gnu/"+l.Name+".570.172.08")
		if l.Soname != "" {
			want = append(want, "/usr/lib/x86_64-linux-gnu/"+l.Soname)
		}
	}
	for _, p := range want {
		m, ok := mounts[p]
		if !assert.True(t, ok, "mount %s", p) {
			continue
		}
		assert.Contains(t, m.Options, "ro", p)
		assert.NotContains(t, m.Options, "rw", p)
		assert.True(t, strings.HasPrefix(m.Source, f.Root+"/"), "%s from the driver root, not %s", p, m.Source)
	}
	assert.Equal(t, filepath.Join(f.Root, "usr/lib/x86_64-linux-gnu/libcuda.so.570.172.08"),
		mounts["/usr/lib/x86_64-linux-gnu/libcuda.so.1"].Source, "the soname is the versioned file")
	assert.NotContains(t, mounts, "/usr/lib/x86_64-linux-gnu/libcuda.so", "the development link is no soname")
	for _, m := range oci.Mounts {
		assert.Contains(t, m.Options, "ro", m.Destination)
	}
	twice := injectIDs(t, dir, DriverDeviceID, DriverDeviceID)
	assert.Equal(t, oci.Mounts, twice.Mounts, "two claims in one container: the driver's files once")
	assert.Nil(t, oci.Hooks, "no hook path: no hooks")
	assert.Empty(t, oci.Process.Env)
}

func TestDriverSpecHooksAndHostRoot(t *testing.T) {
	f := simDriverFiles(t)
	spec, err := BuildDriverSpec(f, DriverOptions{HostRoot: "/run/nvidia/driver", HookPath: "/usr/local/nvidia/toolkit/nvidia-cdi-hook"})
	require.NoError(t, err)
	dir := t.TempDir()
	w, err := NewWriter(dir)
	require.NoError(t, err)
	require.NoError(t, w.WriteDriver(spec))
	oci := injectIDs(t, dir, DriverDeviceID)
	mounts := mountsByDest(oci)
	assert.Equal(t, "/run/nvidia/driver/usr/lib/x86_64-linux-gnu/libcuda.so.570.172.08",
		mounts["/usr/lib/x86_64-linux-gnu/libcuda.so.570.172.08"].Source, "host paths under the host's driver root")
	assert.NotContains(t, mounts, "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "ldconfig makes the soname links")
	require.NotNil(t, oci.Hooks)
	require.Len(t, oci.Hooks.CreateContainer, 3)
	for _, h := range oci.Hooks.CreateContainer {
		assert.Equal(t, "/usr/local/nvidia/toolkit/nvidia-cdi-hook", h.Path)
	}
	assert.Equal(t, []string{"nvidia-cdi-hook", "update-ldcache", "--folder", "/usr/lib/x86_64-linux-gnu"}, oci.Hooks.CreateContainer[2].Args)
	assert.Contains(t, oci.Process.Env, "NVIDIA_CTK_LIBCUDA_DIR=/usr/lib/x86_64-linux-gnu")
}

func TestDriverSpecRefusesEmptyFiles(t *testing.T) {
	_, err := BuildDriverSpec(nvdevice.DriverFiles{Root: "/x"}, DriverOptions{})
	assert.ErrorContains(t, err, "no driver version")
	_, err = BuildDriverSpec(nvdevice.DriverFiles{Root: "/x", Version: "570.172.08"}, DriverOptions{})
	assert.ErrorContains(t, err, "no files found")
}
