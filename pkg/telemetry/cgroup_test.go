package telemetry

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

const (
	idA    = "3f9ac2b1d5e84c7f9a0b6c1d2e3f40516273849a5b6c7d8e9f0a1b2c3d4e5f60"
	idB    = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
	podUID = "8c1f2a3b-4d5e-6f70-8192-a3b4c5d6e7f8"
	podSD  = "8c1f2a3b_4d5e_6f70_8192_a3b4c5d6e7f8" // systemd's escape of the UID
)

func TestParseCgroup(t *testing.T) {
	for _, tc := range []struct {
		name     string
		data     string
		ids      []string
		kubepods bool
	}{
		{"containerd, systemd driver, cgroup v2",
			"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod" + podSD + ".slice/cri-containerd-" + idA + ".scope\n",
			[]string{idA}, true},
		{"containerd, cgroupfs driver, cgroup v2",
			"0::/kubepods/besteffort/pod" + podUID + "/" + idA + "\n",
			[]string{idA}, true},
		{"cgroupfs, Guaranteed pod (no QoS level)",
			"0::/kubepods/pod" + podUID + "/" + idA + "\n",
			[]string{idA}, true},
		{"cgroupfs with an ID of another shape (devcluster's runc)",
			"0::/kubepods/besteffort/pod" + podUID + "/node-a-c42\n",
			[]string{"node-a-c42"}, true},
		{"a runtime's scope under a cgroupfs pod: the scope's ID only",
			"0::/kubepods/besteffort/pod" + podUID + "/crio-" + idA + ".scope\n",
			[]string{idA}, true},
		{"CRI-O, systemd driver",
			"0::/kubepods.slice/kubepods-pod" + podSD + ".slice/crio-" + idA + ".scope\n",
			[]string{idA}, true},
		{"CRI-O with crun: the process one level down",
			"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + podSD + ".slice/crio-" + idA + ".scope/container\n",
			[]string{idA}, true},
		{"CRI-O's conmon is not the container",
			"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + podSD + ".slice/crio-conmon-" + idA + ".scope\n",
			nil, true},
		{"cri-dockerd, systemd driver",
			"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + podSD + ".slice/docker-" + idA + ".scope\n",
			[]string{idA}, true},
		{"cgroup v1, Docker with cgroupfs",
			"12:memory:/kubepods/burstable/pod" + podUID + "/" + idA + "\n" +
				"11:cpu,cpuacct:/kubepods/burstable/pod" + podUID + "/" + idA + "\n" +
				"1:name=systemd:/kubepods/burstable/pod" + podUID + "/" + idA + "\n",
			[]string{idA}, true},
		{"hybrid: v1 hierarchies name it, the v2 line is the root",
			"10:devices:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + podSD + ".slice/cri-containerd-" + idA + ".scope\n" +
				"1:name=systemd:/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + podSD + ".slice/cri-containerd-" + idA + ".scope\n" +
				"0::/\n",
			[]string{idA}, true},
		{"read in a cgroup namespace of our own: a relative path",
			"0::/../../kubepods-besteffort-pod" + podSD + ".slice/cri-containerd-" + idA + ".scope\n",
			[]string{idA}, true},
		{"a bare ID nested anywhere",
			"0::/system.slice/containerd.service/k8s.io/" + idB + "\n",
			[]string{idB}, false},
		{"a host process", "0::/system.slice/sshd.service\n", nil, false},
		{"a host process, v1", "4:memory:/user.slice\n1:name=systemd:/user.slice/user-1000.slice/session-2.scope\n0::/\n", nil, false},
		{"a pod's cgroup without a container's: unknown runtime",
			"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + podSD + ".slice/unknown-runtime-x.scope\n",
			nil, true},
		{"empty (unreadable)", "", nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := parseCgroup(tc.data)
			assert.Equal(t, tc.ids, got.IDs)
			assert.Equal(t, tc.kubepods, got.InKubepods)
		})
	}
}

func TestContainerLinks(t *testing.T) {
	l := parseContainerLinks([]string{
		"train-0_ml_worker-" + idA + ".log",
		"train-0_ml_worker-sidecar-" + idB + ".log", // a container named worker-sidecar
		"web_default_nginx-" + idB + ".log",
		"not-a-link.txt",
		"too_many_parts_here-x.log",
	})
	worker := containerKey{Namespace: "ml", Pod: "train-0", Container: "worker"}
	sidecar := containerKey{Namespace: "ml", Pod: "train-0", Container: "worker-sidecar"}
	assert.True(t, l.OK)
	assert.True(t, l.has(worker, idA))
	assert.False(t, l.has(worker, idB), "worker-sidecar's link is not worker's")
	assert.True(t, l.has(sidecar, idB))
	assert.False(t, l.has(containerKey{Namespace: "default", Pod: "train-0", Container: "worker"}, idA), "another namespace")
	assert.True(t, l.known(idB))
	assert.False(t, l.known("feed"))
}
