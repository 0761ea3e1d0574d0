package telemetry

import (
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

const idC = "c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00"

var (
	ctrA = containerKey{Namespace: "ml", Pod: "train-0", Container: "worker"} // ID idA
	ctrB = containerKey{Namespace: "ml", Pod: "train-1", Container: "worker"} // ID idB
	ctrC = containerKey{Namespace: "ops", Pod: "probe", Container: "dcgm"}    // ID idC
	// links are the log links of A, B and C.
	links = parseContainerLinks([]string{
		"train-0_ml_worker-" + idA + ".log", "train-1_ml_worker-" + idB + ".log", "probe_ops_dcgm-" + idC + ".log",
	})
	inCtr = func(id string) procInfo {
		return procInfo{Readable: true, Cgroup: parseCgroup("0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + podSD + ".slice/cri-containerd-" + id + ".scope")}
	}
	onHost = procInfo{Readable: true, Cgroup: parseCgroup("0::/system.slice/nvidia-persistenced.service")}
)

// proc is a process with mem GiB and an SM share (sm < 0: unsupported).
func proc(pid int, mem, sm float64) nvdevice.ProcessSample {
	p := nvdevice.ProcessSample{PID: pid, UsedMemoryBytes: nvdevice.Read(mem * (1 << 30))}
	if sm >= 0 {
		p.SMUtilization = nvdevice.Read(sm)
	}
	return p
}

func gpu(uuid string, minor int, procs ...nvdevice.ProcessSample) nvdevice.TelemetrySample {
	return nvdevice.TelemetrySample{UUID: uuid, Minor: minor, ProcessesRead: true, Processes: procs}
}

func mig(uuid, parent string, minor, start int, procs ...nvdevice.ProcessSample) nvdevice.TelemetrySample {
	s := gpu(uuid, minor, procs...)
	s.ParentUUID, s.MigProfile, s.MigStart = parent, "3g.40gb", start
	return s
}

func dra(c containerKey, device, claim string) podHold {
	return podHold{containerKey: c, Device: device, Claim: claim, ClaimNamespace: c.Namespace}
}

func dp(c containerKey, uuid string) podHold { return podHold{containerKey: c, UUID: uuid} }

// render writes a device's attribution in one line: its holders, then
// "unknown", or each container's and the unattributed figures (GiB; "-":
// not sent).
func render(d deviceAttribution) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s[", d.Device)
	for i, h := range d.Holders {
		if i > 0 {
			b.WriteString(" ")
		}
		fmt.Fprintf(&b, "%s/%s/%s(%s)", h.Namespace, h.Pod, h.Container, h.Claim)
	}
	b.WriteString("]")
	if !d.Known {
		return b.String() + " unknown"
	}
	fig := func(u usage) string {
		m, sm := "-", "-"
		if u.MemoryOK {
			m = fmt.Sprint(u.Memory / (1 << 30))
		}
		if u.SMOK {
			sm = fmt.Sprint(u.SM)
		}
		return fmt.Sprintf("m=%s,sm=%s,n=%d", m, sm, u.Processes)
	}
	for _, c := range d.Containers {
		fmt.Fprintf(&b, " %s/%s/%s:%s", c.Namespace, c.Pod, c.Container, fig(c.usage))
	}
	if d.Unattributed != nil {
		fmt.Fprintf(&b, " un:%s", fig(*d.Unattributed))
	}
	return b.String()
}

func TestAttribute(t *testing.T) {
	all := map[int]procInfo{100: inCtr(idA), 101: inCtr(idA), 200: inCtr(idB), 300: onHost, 400: inCtr(idC)}
	for _, tc := range []struct {
		name       string
		samples    []nvdevice.TelemetrySample
		holds      []podHold
		admin      map[claimDevice]bool
		procs      map[int]procInfo // all if nil
		links      *containerLinks  // links if nil
		want       []string         // render of each device
		unresolved int
	}{
		{name: "exclusive GPU, and a free one",
			samples: []nvdevice.TelemetrySample{gpu("GPU-a", 3, proc(100, 20, 0.4)), gpu("GPU-c", 4)},
			holds:   []podHold{dra(ctrA, "gpu-3", "c1")},
			want: []string{
				"gpu-3[ml/train-0/worker(c1)] ml/train-0/worker:m=20,sm=0.4,n=1 un:m=0,sm=0,n=0",
				"gpu-4[] un:m=0,sm=0,n=0",
			}},
		{name: "a holder without processes has 0, known",
			samples: []nvdevice.TelemetrySample{gpu("GPU-a", 3)},
			holds:   []podHold{dra(ctrA, "gpu-3", "c1")},
			want:    []string{"gpu-3[ml/train-0/worker(c1)] ml/train-0/worker:m=0,sm=0,n=0 un:m=0,sm=0,n=0"}},
		{name: "shared device split per container",
			samples: []nvdevice.TelemetrySample{gpu("GPU-a", 3, proc(100, 20, 0.25), proc(101, 10, 0.25), proc(200, 8, 0.3))},
			holds:   []podHold{dra(ctrB, "gpu-3", "c2"), dra(ctrA, "gpu-3", "c1")},
			want:    []string{"gpu-3[ml/train-0/worker(c1) ml/train-1/worker(c2)] ml/train-0/worker:m=30,sm=0.5,n=2 ml/train-1/worker:m=8,sm=0.3,n=1 un:m=0,sm=0,n=0"}},
		{name: "one container, two shares (two claims): one figure, two info series",
			samples: []nvdevice.TelemetrySample{gpu("GPU-a", 3, proc(100, 20, 0.4))},
			holds:   []podHold{dra(ctrA, "gpu-3", "c1"), dra(ctrA, "gpu-3", "c3")},
			want:    []string{"gpu-3[ml/train-0/worker(c1) ml/train-0/worker(c3)] ml/train-0/worker:m=20,sm=0.4,n=1 un:m=0,sm=0,n=0"}},
		{name: "a host process is unattributed",
			samples: []nvdevice.TelemetrySample{gpu("GPU-a", 3, proc(100, 20, 0.4), proc(300, 1, 0.1))},
			holds:   []podHold{dra(ctrA, "gpu-3", "c1")},
			want:    []string{"gpu-3[ml/train-0/worker(c1)] ml/train-0/worker:m=20,sm=0.4,n=1 un:m=1,sm=0.1,n=1"}},
		{name: "a process of a container that holds another device is unattributed here",
			samples: []nvdevice.TelemetrySample{gpu("GPU-a", 3, proc(200, 4, 0.2)), gpu("GPU-c", 4)},
			holds:   []podHold{dra(ctrA, "gpu-3", "c1"), dra(ctrB, "gpu-4", "c2")},
			want: []string{
				"gpu-3[ml/train-0/worker(c1)] ml/train-0/worker:m=0,sm=0,n=0 un:m=4,sm=0.2,n=1",
				"gpu-4[ml/train-1/worker(c2)] ml/train-1/worker:m=0,sm=0,n=0 un:m=0,sm=0,n=0",
			}},
		{name: "MIG: processes on MIG devices, no SM figures; the GPU in MIG mode has no unattributed figures",
			samples: []nvdevice.TelemetrySample{gpu("GPU-m", 5), mig("MIG-x", "GPU-m", 5, 4, proc(100, 20, -1)), mig("MIG-y", "GPU-m", 5, 0, proc(300, 2, -1))},
			holds:   []podHold{dra(ctrA, "gpu-5-mig-3g-40gb-4", "c1")},
			want: []string{
				"gpu-5[]",
				"gpu-5-mig-3g-40gb-4[ml/train-0/worker(c1)] ml/train-0/worker:m=20,sm=-,n=1 un:m=0,sm=-,n=0",
				"gpu-5-mig-3g-40gb-0[] un:m=2,sm=-,n=1",
			}},
		{name: "MIG: a whole GPU in MIG mode (device plugin, strategy none) has its container's processes on its MIG devices",
			samples: []nvdevice.TelemetrySample{gpu("GPU-m", 5), mig("MIG-x", "GPU-m", 5, 4, proc(200, 20, -1)), mig("MIG-y", "GPU-m", 5, 0, proc(200, 5, -1), proc(300, 2, -1))},
			holds:   []podHold{dp(ctrB, "GPU-m")},
			want: []string{
				"gpu-5[ml/train-1/worker()] ml/train-1/worker:m=25,sm=-,n=1",
				"gpu-5-mig-3g-40gb-4[] un:m=0,sm=-,n=0",
				"gpu-5-mig-3g-40gb-0[] un:m=2,sm=-,n=1",
			}},
		{name: "device plugin replicas: one holder per container",
			samples: []nvdevice.TelemetrySample{gpu("GPU-a", 3, proc(100, 10, 0.2), proc(200, 6, 0.1))},
			holds:   []podHold{dp(ctrA, "GPU-a"), dp(ctrA, "GPU-a"), dp(ctrB, "GPU-a"), dp(ctrB, "GPU-zz")},
			want:    []string{"gpu-3[ml/train-0/worker() ml/train-1/worker()] ml/train-0/worker:m=10,sm=0.2,n=1 ml/train-1/worker:m=6,sm=0.1,n=1 un:m=0,sm=0,n=0"}},
		{name: "unreadable cgroup: that device's figures are left out, the others' are not",
			samples:    []nvdevice.TelemetrySample{gpu("GPU-a", 3, proc(100, 20, 0.4), proc(999, 1, 0.1)), gpu("GPU-c", 4, proc(200, 3, 0.3))},
			holds:      []podHold{dra(ctrA, "gpu-3", "c1"), dra(ctrB, "gpu-4", "c2")},
			procs:      map[int]procInfo{100: inCtr(idA), 200: inCtr(idB), 999: {}},
			unresolved: 1,
			want: []string{
				"gpu-3[ml/train-0/worker(c1)] unknown",
				"gpu-4[ml/train-1/worker(c2)] ml/train-1/worker:m=3,sm=0.3,n=1 un:m=0,sm=0,n=0",
			}},
		{name: "a container ID without a link is unresolved",
			samples:    []nvdevice.TelemetrySample{gpu("GPU-a", 3, proc(100, 20, 0.4))},
			holds:      []podHold{dra(ctrA, "gpu-3", "c1")},
			procs:      map[int]procInfo{100: inCtr("feedfeedfeedfeedfeedfeedfeedfeedfeedfeedfeedfeedfeedfeedfeedfeed")},
			unresolved: 1,
			want:       []string{"gpu-3[ml/train-0/worker(c1)] unknown"}},
		{name: "an unreadable log directory leaves containers' processes unresolved, host processes not",
			samples:    []nvdevice.TelemetrySample{gpu("GPU-a", 3, proc(100, 20, 0.4)), gpu("GPU-c", 4, proc(300, 1, 0.1))},
			holds:      []podHold{dra(ctrA, "gpu-3", "c1")},
			links:      &containerLinks{},
			unresolved: 1,
			want:       []string{"gpu-3[ml/train-0/worker(c1)] unknown", "gpu-4[] un:m=1,sm=0.1,n=1"}},
		{name: "a pod's process whose runtime the parser does not know is unresolved, not a host process",
			samples:    []nvdevice.TelemetrySample{gpu("GPU-a", 3, proc(100, 20, 0.4))},
			procs:      map[int]procInfo{100: {Readable: true, Cgroup: parseCgroup("0::/kubepods.slice/kubepods-pod" + podSD + ".slice/kata-x.scope")}},
			unresolved: 1,
			want:       []string{"gpu-3[] unknown"}},
		{name: "admin access is no use of the device: its container's process is unattributed",
			samples: []nvdevice.TelemetrySample{gpu("GPU-a", 3, proc(100, 20, 0.4), proc(400, 1, 0))},
			holds:   []podHold{dra(ctrA, "gpu-3", "c1"), dra(ctrC, "gpu-3", "monitor")},
			admin:   map[claimDevice]bool{{Namespace: "ops", Claim: "monitor", Device: "gpu-3"}: true},
			want:    []string{"gpu-3[ml/train-0/worker(c1)] ml/train-0/worker:m=20,sm=0.4,n=1 un:m=1,sm=0,n=1"}},
		{name: "processes not read: unknown, yet none unresolved",
			samples: []nvdevice.TelemetrySample{{UUID: "GPU-a", Minor: 3}},
			holds:   []podHold{dra(ctrA, "gpu-3", "c1")},
			want:    []string{"gpu-3[ml/train-0/worker(c1)] unknown"}},
		{name: "a figure one process lacks is not summed",
			samples: []nvdevice.TelemetrySample{gpu("GPU-a", 3, proc(100, 20, 0.4), nvdevice.ProcessSample{PID: 101})},
			holds:   []podHold{dra(ctrA, "gpu-3", "c1")},
			want:    []string{"gpu-3[ml/train-0/worker(c1)] ml/train-0/worker:m=-,sm=-,n=2 un:m=0,sm=0,n=0"}},
		{name: "another driver's devices are not the node's",
			samples: []nvdevice.TelemetrySample{gpu("GPU-a", 3, proc(100, 20, 0.4))},
			holds:   podHoldsOf(podResourcesWith(ctrA, "gpu.nvidia.com", "n1", "gpu-3"), "n1"),
			want:    []string{"gpu-3[] un:m=20,sm=0.4,n=1"}},
		{name: "another pool's devices are not the node's",
			samples: []nvdevice.TelemetrySample{gpu("GPU-a", 3, proc(100, 20, 0.4))},
			holds:   podHoldsOf(podResourcesWith(ctrA, "gpu.gpudra.dev", "n2", "gpu-3"), "n1"),
			want:    []string{"gpu-3[] un:m=20,sm=0.4,n=1"}},
		{name: "gpudra's devices in the node's pool are",
			samples: []nvdevice.TelemetrySample{gpu("GPU-a", 3, proc(100, 20, 0.4))},
			holds:   podHoldsOf(podResourcesWith(ctrA, "gpu.gpudra.dev", "n1", "gpu-3"), "n1"),
			want:    []string{"gpu-3[ml/train-0/worker(c1)] ml/train-0/worker:m=20,sm=0.4,n=1 un:m=0,sm=0,n=0"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := attribInput{Samples: tc.samples, Holds: tc.holds, Admin: tc.admin, Procs: tc.procs, Links: links}
			if in.Procs == nil {
				in.Procs = all
			}
			if tc.links != nil {
				in.Links = *tc.links
			}
			got := attribute(in)
			assert.True(t, got.Up)
			var lines []string
			for _, d := range got.Devices {
				lines = append(lines, render(d))
			}
			assert.Equal(t, tc.want, lines)
			assert.Equal(t, tc.unresolved, got.Unresolved)
		})
	}
}
