package nodeagent

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpudra/gpudra/devcluster/noderuntime"
)

// TestContainerInKubeletCgroup: a container runc starts with the
// kubelet's cgroup path is in that cgroup, as /proc/<pid>/cgroup of its
// real host PID (noderuntime.OCIRuntime.PID) shows it in every hierarchy the host
// mounts (here cgroup v1 controllers and the hybrid v2 one, or v2 alone);
// once it is deleted and its pod's cgroup removed, neither is left.
func TestContainerInKubeletCgroup(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("real containers need root")
	}
	bin := func(env, def string) string {
		if p := os.Getenv(env); p != "" {
			return p
		}
		p, _ := filepath.Abs(def)
		return p
	}
	rt := &noderuntime.OCIRuntime{Runc: bin("RUNC", "../../bin/runc"), Probe: bin("PROBE", "../../bin/gpudra-probe"), Root: t.TempDir()}
	if err := rt.Usable(); err != nil {
		t.Skipf("%v (make probe bin/runc builds them; RUNC and PROBE name others)", err)
	}
	ctx := context.Background()
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{UID: "6d1f2c3b-cgroup-test"}, Spec: v1.PodSpec{Containers: []v1.Container{{Name: "c"}}}}
	id := newContainerID(pod.UID, "c", 1)
	cgroup := containerCgroupPath(pod, id)
	spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{CgroupsPath: cgroup, Resources: &oci.LinuxResources{}}}
	_, err := rt.Start(ctx, id, spec)
	require.NoError(t, err)
	t.Cleanup(func() { _ = rt.Stop(context.Background(), id); _ = rt.RemoveCgroup(filepath.Dir(cgroup)) })
	pid, err := rt.PID(ctx, id)
	require.NoError(t, err)
	data, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cgroup"))
	require.NoError(t, err)
	t.Logf("/proc/%d/cgroup:\n%s", pid, data)
	lines := strings.Split(strings.TrimSpace(string(data)), "\n")
	require.NotEmpty(t, lines)
	for _, line := range lines {
		parts := strings.SplitN(line, ":", 3)
		require.Len(t, parts, 3, line)
		assert.True(t, strings.HasSuffix(parts[2], cgroup), "hierarchy %q: the container is in %s, want the kubelet's %s", parts[1], parts[2], cgroup)
	}
	// The cgroup's own list of processes holds it, in every hierarchy.
	procsFiles, _ := filepath.Glob(filepath.Join(noderuntime.CgroupRoot, "*", cgroup, "cgroup.procs"))
	require.NotEmpty(t, procsFiles)
	for _, f := range procsFiles {
		procs, err := os.ReadFile(f)
		require.NoError(t, err)
		assert.Contains(t, strings.Fields(string(procs)), strconv.Itoa(pid), f)
	}
	cmdline, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cmdline"))
	require.NoError(t, err)
	assert.Contains(t, string(cmdline), "/gpudra-probe", "the PID is the container's first process, the probe")

	podDirs := func() []string {
		dirs, _ := filepath.Glob(filepath.Join(noderuntime.CgroupRoot, "*", filepath.Dir(cgroup)))
		more, _ := filepath.Glob(filepath.Join(noderuntime.CgroupRoot, filepath.Dir(cgroup)))
		return append(dirs, more...)
	}
	require.NotEmpty(t, podDirs(), "the pod's cgroup exists while its container runs")
	require.NoError(t, rt.Stop(ctx, id))
	require.NoError(t, rt.RemoveCgroup(filepath.Dir(cgroup)))
	assert.Empty(t, podDirs(), "the pod's cgroup removed in every hierarchy")
	_, err = rt.PID(ctx, id)
	assert.Error(t, err, "a deleted container has no PID")
}
