package nodeagent

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"testing"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/gpudra/gpudra/devcluster/noderuntime"
	"github.com/gpudra/gpudra/pkg/probe"
)

// fakeRunner runs containers as entries in a map: each gets the next PID.
// A container whose environment holds FAIL_START=1 fails to start.
type fakeRunner struct {
	running map[string]int
	specs   map[string]*oci.Spec
	nextPID int
	// removedCgroups are the cgroups RemoveCgroup was called for.
	removedCgroups []string
	// exited are the exit codes of containers that exited, by id.
	exited map[string]int32
}

func (f *fakeRunner) Exited(id string) (int32, bool) {
	code, ok := f.exited[id]
	return code, ok
}

func (f *fakeRunner) Start(_ context.Context, id string, spec *oci.Spec) (*probe.Report, error) {
	if slices.Contains(spec.Process.Env, "FAIL_START=1") {
		return nil, errors.New("runc run: exit status 1")
	}
	f.nextPID++
	f.running[id], f.specs[id] = f.nextPID, spec
	return &probe.Report{}, nil
}

func (f *fakeRunner) PID(_ context.Context, id string) (int, error) {
	pid, ok := f.running[id]
	if !ok {
		return 0, errors.New("not running")
	}
	return pid, nil
}

func (f *fakeRunner) Stop(_ context.Context, id string) error {
	delete(f.running, id)
	return nil
}

func (f *fakeRunner) RemoveCgroup(cgroup string) error {
	f.removedCgroups = append(f.removedCgroups, cgroup)
	return nil
}

// fakeSims is the simulator's process list: devices by PID. StartProcess
// on failDevice fails.
type fakeSims struct {
	procs      map[int][]string
	failDevice string
}

func (f *fakeSims) StartProcess(dev string, pid int, _ float64, _ uint64) error {
	if dev == f.failDevice {
		return errors.New("no such device")
	}
	f.procs[pid] = append(f.procs[pid], dev)
	return nil
}

func (f *fakeSims) EndProcess(pid int) { delete(f.procs, pid) }

// files lists every file and link below root, relative.
func files(t *testing.T, root string) []string {
	t.Helper()
	var out []string
	require.NoError(t, filepath.Walk(root, func(p string, info os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		if p != root {
			rel, _ := filepath.Rel(root, p)
			out = append(out, rel)
		}
		return nil
	}))
	sort.Strings(out)
	return out
}

// TestContainerLifecycle: the kubelet's containers get a 64-hex ID, a
// kubelet-shaped cgroup, a log link to their log file and, where they
// declare a load, their process on each of their devices; stopping the
// pod, a failed start and a retried start leave no container, process,
// link or log behind.
func TestContainerLifecycle(t *testing.T) {
	const uid = types.UID("0b5c1f3e-2b1d-4c8e-9a6f-1d2e3f405162")
	newPod := func(failSecond bool) *v1.Pod {
		second := v1.Container{Name: "second", Env: []v1.EnvVar{{Name: SimLoadEnv, Value: "memory=1Gi"}}}
		if failSecond {
			second.Env = append(second.Env, v1.EnvVar{Name: "FAIL_START", Value: "1"})
		}
		return &v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p", UID: uid}, Spec: v1.PodSpec{Containers: []v1.Container{
			{Name: "first", Env: []v1.EnvVar{{Name: SimLoadEnv, Value: "sm=0.5,memory=2Gi"}}}, second, {Name: "idle"}}}}
	}
	views := func() map[string]noderuntime.ContainerView {
		return map[string]noderuntime.ContainerView{"first": {GPUs: []string{"GPU-a", "GPU-b"}}, "second": {GPUs: []string{"MIG-c"}}, "idle": {GPUs: []string{"GPU-d"}}}
	}
	specs := func() map[string]*oci.Spec {
		out := map[string]*oci.Spec{}
		for _, n := range []string{"first", "second", "idle"} {
			out[n] = &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{Resources: &oci.LinuxResources{}}}
		}
		return out
	}
	setup := func(t *testing.T) (*kubelet, *fakeRunner, *fakeSims) {
		runner := &fakeRunner{running: map[string]int{}, specs: map[string]*oci.Spec{}}
		sims := &fakeSims{procs: map[int][]string{}}
		k := &kubelet{runner: runner, sims: sims, logRoot: t.TempDir(), containers: map[types.UID][]runningContainer{}}
		return k, runner, sims
	}
	loads := func(t *testing.T, pod *v1.Pod) map[string]SimLoad {
		l, _, err := podSimLoads(pod)
		require.NoError(t, err)
		return l
	}
	ctx := context.Background()

	t.Run("start and stop", func(t *testing.T) {
		k, runner, sims := setup(t)
		pod := newPod(false)
		require.NoError(t, k.startContainers(ctx, pod, views(), specs(), loads(t, pod)))
		require.Len(t, k.containers[uid], 3)
		podDir := "pods/ns_p_" + string(uid)
		var want []string
		for _, c := range k.containers[uid] {
			assert.Regexp(t, `^[0-9a-f]{64}$`, c.ID)
			assert.Equal(t, "runc://"+c.ID, k.containerID(pod, c.Name))
			assert.Equal(t, "/kubepods/besteffort/pod"+string(uid)+"/"+c.ID, runner.specs[c.ID].Linux.CgroupsPath)
			link := filepath.Join(k.logRoot, "containers", "p_ns_"+c.Name+"-"+c.ID+".log")
			target, err := os.Readlink(link)
			require.NoError(t, err, "container %s's log link", c.Name)
			assert.Equal(t, filepath.Join(k.logRoot, podDir, c.Name, "0.log"), target)
			want = append(want, "containers/p_ns_"+c.Name+"-"+c.ID+".log", podDir+"/"+c.Name, podDir+"/"+c.Name+"/0.log")
		}
		want = append(want, "containers", "pods", podDir)
		sort.Strings(want)
		assert.Equal(t, want, files(t, k.logRoot))
		first, second := k.containers[uid][0], k.containers[uid][1]
		assert.Equal(t, map[int][]string{first.PID: {"GPU-a", "GPU-b"}, second.PID: {"MIG-c"}}, sims.procs,
			"each loaded container's process on each of its devices, none for the one without a load")
		assert.NotEqual(t, first.ID, second.ID)

		k.stopContainers(ctx, uid)
		assert.Empty(t, runner.running, "containers stopped")
		assert.Empty(t, sims.procs, "processes off the devices")
		assert.Equal(t, []string{"containers", "pods"}, files(t, k.logRoot), "links, logs and the pod's log directory gone")
		assert.Equal(t, []string{"/kubepods/besteffort/pod" + string(uid)}, runner.removedCgroups, "the pod's cgroup removed")
		assert.Equal(t, "devcluster://"+string(uid)+"/first", k.containerID(pod, "first"))
	})

	t.Run("a failed start leaves nothing", func(t *testing.T) {
		k, runner, sims := setup(t)
		pod := newPod(true)
		err := k.startContainers(ctx, pod, views(), specs(), loads(t, pod))
		require.ErrorContains(t, err, "container second: runc run")
		assert.Empty(t, k.containers[uid])
		assert.Empty(t, runner.running, "the first container stopped")
		assert.Empty(t, sims.procs, "the first container's process off its devices")
		assert.Equal(t, []string{"containers", "pods"}, files(t, k.logRoot), "no log link or log left")
		assert.Equal(t, []string{"/kubepods/besteffort/pod" + string(uid)}, runner.removedCgroups, "the pod's cgroup removed")
	})

	t.Run("a device refusing the process leaves nothing", func(t *testing.T) {
		k, runner, sims := setup(t)
		sims.failDevice = "GPU-b"
		pod := newPod(false)
		err := k.startContainers(ctx, pod, views(), specs(), loads(t, pod))
		require.ErrorContains(t, err, "container first: GPUDRA_SIM_LOAD: process 1 on GPU-b: no such device")
		assert.Empty(t, runner.running)
		assert.Empty(t, sims.procs, "no ghost process on GPU-a")
		assert.Equal(t, []string{"containers", "pods"}, files(t, k.logRoot))
	})

	t.Run("a retried start replaces the earlier try", func(t *testing.T) {
		k, runner, sims := setup(t)
		pod := newPod(false)
		require.NoError(t, k.startContainers(ctx, pod, views(), specs(), loads(t, pod)))
		before := k.containers[uid]
		require.NoError(t, k.startContainers(ctx, pod, views(), specs(), loads(t, pod)))
		after := k.containers[uid]
		require.Len(t, after, 3)
		for i := range after {
			assert.NotEqual(t, before[i].ID, after[i].ID, "a new try, new container IDs")
			assert.NotContains(t, runner.running, before[i].ID)
			assert.NoFileExists(t, before[i].Log.Link)
			assert.FileExists(t, after[i].Log.Link)
		}
		assert.Equal(t, map[int][]string{after[0].PID: {"GPU-a", "GPU-b"}, after[1].PID: {"MIG-c"}}, sims.procs,
			"the earlier try's processes gone: no ghost")
		assert.Len(t, runner.running, 3)
	})
}

func TestContainerCgroupPath(t *testing.T) {
	const id = "c0ffee"
	guaranteed := v1.ResourceList{v1.ResourceCPU: resource.MustParse("1"), v1.ResourceMemory: resource.MustParse("1Gi")}
	for _, tc := range []struct {
		name      string
		resources v1.ResourceRequirements
		want      string
	}{
		{"best effort", v1.ResourceRequirements{}, "/kubepods/besteffort/podu1/" + id},
		{"burstable", v1.ResourceRequirements{Requests: v1.ResourceList{v1.ResourceCPU: resource.MustParse("1")}}, "/kubepods/burstable/podu1/" + id},
		{"guaranteed", v1.ResourceRequirements{Requests: guaranteed, Limits: guaranteed}, "/kubepods/podu1/" + id},
	} {
		t.Run(tc.name, func(t *testing.T) {
			pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{UID: "u1"}, Spec: v1.PodSpec{Containers: []v1.Container{{Name: "c", Resources: tc.resources}}}}
			assert.Equal(t, tc.want, containerCgroupPath(pod, id))
		})
	}
}
