package imagemode

import (
	"slices"
	"strings"
	"testing"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"

	"github.com/gpudra/gpudra/devcluster/noderuntime"
)

func TestImageContainerSpec(t *testing.T) {
	base := func() *v1.Pod {
		return &v1.Pod{
			ObjectMeta: metav1.ObjectMeta{Name: "gpudra-kubelet-plugin-n0", Namespace: "gpudra-system", UID: "uid-1",
				Labels: map[string]string{"app": "plugin"}},
			Spec: v1.PodSpec{NodeName: "n0", ServiceAccountName: "sa", Containers: []v1.Container{{
				Name: "plugin", Command: []string{"gpudra-kubelet-plugin"}, Args: []string{"-v=2", "--node=$(NODE_NAME)"},
				Env: []v1.EnvVar{
					{Name: "NODE_NAME", ValueFrom: &v1.EnvVarSource{FieldRef: &v1.ObjectFieldSelector{FieldPath: "spec.nodeName"}}},
					{Name: "POD_UID", ValueFrom: &v1.EnvVarSource{FieldRef: &v1.ObjectFieldSelector{FieldPath: "metadata.uid"}}},
					{Name: "APP", ValueFrom: &v1.EnvVarSource{FieldRef: &v1.ObjectFieldSelector{FieldPath: "metadata.labels['app']"}}},
					{Name: "PLUGIN_DATA_DIR", Value: "/d/nodes/$(NODE_NAME)/plugins"},
					{Name: "ESCAPED", Value: "$$(NODE_NAME)"},
					{Name: "PATH", Value: "/custom"},
				},
				VolumeMounts: []v1.VolumeMount{{Name: "data", MountPath: "/data"}, {Name: "cfg", MountPath: "/etc/cfg", ReadOnly: true, SubPath: "sub"}},
			}}},
		}
	}
	in := func(pod *v1.Pod) imageContainer {
		return imageContainer{Pod: pod, Container: &pod.Spec.Containers[0], Rootfs: "/rootfs", ImageEnv: []string{"PATH=/usr/bin"},
			ImageUser: "65532:65532", Volumes: map[string]string{"data": "/host/data", "cfg": "/host/cfg"},
			ServiceEnv: []string{"KUBERNETES_SERVICE_HOST=127.0.0.1", "KUBERNETES_SERVICE_PORT=6443"}}
	}
	mount := func(s *oci.Spec, dest string) *oci.Mount {
		for i := range s.Mounts {
			if s.Mounts[i].Destination == dest {
				return &s.Mounts[i]
			}
		}
		return nil
	}
	for _, tc := range []struct {
		name    string
		edit    func(*v1.Pod)
		wantErr string
		check   func(*testing.T, *oci.Spec)
	}{{
		name: "env, downward API, $(VAR), command, mounts, the image's user",
		check: func(t *testing.T, s *oci.Spec) {
			assert.Equal(t, []string{"gpudra-kubelet-plugin", "-v=2", "--node=n0"}, s.Process.Args)
			for _, want := range []string{"NODE_NAME=n0", "POD_UID=uid-1", "APP=plugin", "PLUGIN_DATA_DIR=/d/nodes/n0/plugins",
				"ESCAPED=$(NODE_NAME)", "PATH=/custom", "KUBERNETES_SERVICE_HOST=127.0.0.1"} {
				assert.Contains(t, s.Process.Env, want)
			}
			assert.False(t, slices.Contains(s.Process.Env, "PATH=/usr/bin"), "the container's PATH replaces the image's")
			assert.Equal(t, oci.User{UID: 65532, GID: 65532}, s.Process.User)
			assert.False(t, s.Root.Readonly)
			assert.Equal(t, "/host/data", mount(s, "/data").Source)
			assert.Contains(t, mount(s, "/data").Options, "rw")
			assert.Equal(t, "/host/cfg/sub", mount(s, "/etc/cfg").Source)
			assert.Contains(t, mount(s, "/etc/cfg").Options, "ro")
			var ns []oci.LinuxNamespaceType
			for _, n := range s.Linux.Namespaces {
				ns = append(ns, n.Type)
			}
			assert.Contains(t, ns, oci.NetworkNamespace)
			assert.Contains(t, ns, oci.PIDNamespace)
			assert.False(t, s.Process.NoNewPrivileges)
			assert.Equal(t, noderuntime.DefaultCapabilities, s.Process.Capabilities.Bounding)
		},
	}, {
		name: "privileged root with hostPID: every capability and device, the host's PIDs",
		edit: func(p *v1.Pod) {
			p.Spec.HostPID = true
			p.Spec.Containers[0].SecurityContext = &v1.SecurityContext{Privileged: ptr.To(true), RunAsUser: ptr.To(int64(0))}
		},
		check: func(t *testing.T, s *oci.Spec) {
			assert.Equal(t, oci.User{UID: 0, GID: 0}, s.Process.User)
			assert.Contains(t, s.Process.Capabilities.Bounding, "CAP_SYS_ADMIN")
			assert.True(t, s.Linux.Resources.Devices[0].Allow)
			assert.Empty(t, s.Linux.MaskedPaths)
			for _, n := range s.Linux.Namespaces {
				assert.NotEqual(t, oci.PIDNamespace, n.Type)
			}
		},
	}, {
		name: "the controller's: non-root, read-only root, no capabilities, no privilege escalation",
		edit: func(p *v1.Pod) {
			p.Spec.SecurityContext = &v1.PodSecurityContext{RunAsNonRoot: ptr.To(true), RunAsUser: ptr.To(int64(65532))}
			p.Spec.Containers[0].SecurityContext = &v1.SecurityContext{ReadOnlyRootFilesystem: ptr.To(true),
				AllowPrivilegeEscalation: ptr.To(false), Capabilities: &v1.Capabilities{Drop: []v1.Capability{"ALL"}}}
		},
		check: func(t *testing.T, s *oci.Spec) {
			assert.Equal(t, oci.User{UID: 65532, GID: 65532}, s.Process.User)
			assert.True(t, s.Root.Readonly)
			assert.True(t, s.Process.NoNewPrivileges)
			assert.Empty(t, s.Process.Capabilities.Bounding)
			assert.False(t, s.Linux.Resources.Devices[0].Allow)
		},
	}, {
		name: "capabilities added to the defaults",
		edit: func(p *v1.Pod) {
			p.Spec.Containers[0].SecurityContext = &v1.SecurityContext{Capabilities: &v1.Capabilities{Add: []v1.Capability{"SYS_ADMIN"}, Drop: []v1.Capability{"CHOWN"}}}
		},
		check: func(t *testing.T, s *oci.Spec) {
			assert.Contains(t, s.Process.Capabilities.Bounding, "CAP_SYS_ADMIN")
			assert.NotContains(t, s.Process.Capabilities.Bounding, "CAP_CHOWN")
		},
	}, {
		name: "runAsNonRoot as root is refused",
		edit: func(p *v1.Pod) {
			p.Spec.SecurityContext = &v1.PodSecurityContext{RunAsNonRoot: ptr.To(true), RunAsUser: ptr.To(int64(0))}
		},
		wantErr: "pod gpudra-system/gpudra-kubelet-plugin-n0 container plugin: securityContext: runAsNonRoot",
	}, {
		name:    "a mount of a volume the pod lacks",
		edit:    func(p *v1.Pod) { p.Spec.Containers[0].VolumeMounts[0].Name = "dta" },
		wantErr: `volumeMounts /data: the pod has no volume "dta"`,
	}, {
		name: "an unsupported downward API field",
		edit: func(p *v1.Pod) {
			p.Spec.Containers[0].Env[0].ValueFrom.FieldRef.FieldPath = "spec.nodname"
		},
		wantErr: `env NODE_NAME: fieldRef "spec.nodname"`,
	}, {
		name: "a secret's key as a variable",
		edit: func(p *v1.Pod) {
			p.Spec.Containers[0].Env[0].ValueFrom = &v1.EnvVarSource{SecretKeyRef: &v1.SecretKeySelector{Key: "k"}}
		},
		wantErr: "env NODE_NAME: only value and valueFrom.fieldRef",
	}, {
		name:    "no command",
		edit:    func(p *v1.Pod) { p.Spec.Containers[0].Command = nil },
		wantErr: "no command",
	}} {
		t.Run(tc.name, func(t *testing.T) {
			pod := base()
			if tc.edit != nil {
				tc.edit(pod)
			}
			s, err := imageContainerSpec(in(pod))
			if tc.wantErr != "" {
				require.Error(t, err)
				assert.True(t, strings.Contains(err.Error(), tc.wantErr), "error %q, want %q", err, tc.wantErr)
				return
			}
			require.NoError(t, err)
			tc.check(t, s)
		})
	}
}
