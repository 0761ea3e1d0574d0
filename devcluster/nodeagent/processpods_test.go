package nodeagent

import (
	"testing"

	"github.com/stretchr/testify/assert"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpudra/gpudra/devcluster/noderuntime"
)

func TestContainerArgv(t *testing.T) {
	hostPath := func(name, p string) v1.Volume {
		return v1.Volume{Name: name, VolumeSource: v1.VolumeSource{HostPath: &v1.HostPathVolumeSource{Path: p}}}
	}
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{UID: "pod-uid"}, Spec: v1.PodSpec{
		Containers: []v1.Container{{
			Command: []string{"/usr/bin/gpudra-mps-server", "--dir", "/srv/mps/a"},
			Args: []string{"--driver-root=/driver-root", "--control-binary=/driver-root/usr/bin/x", "--log=/dev/shm/log",
				"--other=/dev/null", "-v=2", "/driver-rootless", "--dir=/srv/mps"},
			Env: []v1.EnvVar{{Name: "A", Value: "/dev/shm"}, {Name: "B", Value: "/elsewhere"},
				{Name: "C", ValueFrom: &v1.EnvVarSource{FieldRef: &v1.ObjectFieldSelector{FieldPath: "spec.nodeName"}}}},
			VolumeMounts: []v1.VolumeMount{{Name: "root", MountPath: "/driver-root"}, {Name: "shm", MountPath: "/dev/shm/"},
				{Name: "dev", MountPath: "/dev"}, {Name: "srv", MountPath: "/srv/mps"}, {Name: "cfg", MountPath: "/etc/cfg"}},
		}},
		Volumes: []v1.Volume{hostPath("root", "/"), hostPath("shm", "/host/mps/shm"), hostPath("dev", "/hostdev"), hostPath("srv", "/host/mps"),
			{Name: "cfg", VolumeSource: v1.VolumeSource{EmptyDir: &v1.EmptyDirVolumeSource{}}}},
	}}
	args, env := containerArgv(pod)
	assert.Equal(t, []string{"--dir", "/host/mps/a", "--driver-root=/", "--control-binary=/usr/bin/x", "--log=/host/mps/shm/log",
		"--other=/hostdev/null", "-v=2", "/driver-rootless", "--dir=/host/mps"}, args)
	assert.Equal(t, []string{"A=/host/mps/shm", "B=/elsewhere", noderuntime.ContainerMarker("pod-uid")}, env)
}

func TestProcessCommand(t *testing.T) {
	for _, tc := range []struct {
		name       string
		containers []v1.Container
		want       bool
	}{
		{"mps server", []v1.Container{{Command: []string{"gpudra-mps-server"}}}, true},
		{"mps server by path", []v1.Container{{Command: []string{"/bin/gpudra-mps-server"}}}, true},
		{"other command", []v1.Container{{Command: []string{"sleep"}}}, false},
		{"no command", []v1.Container{{Args: []string{"gpudra-mps-server"}}}, false},
		{"two containers", []v1.Container{{Command: []string{"gpudra-mps-server"}}, {Command: []string{"gpudra-mps-server"}}}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := processCommand(&v1.Pod{Spec: v1.PodSpec{Containers: tc.containers}})
			assert.Equal(t, tc.want, got != nil)
		})
	}
}
