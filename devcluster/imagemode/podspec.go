package imagemode

import (
	"fmt"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	v1 "k8s.io/api/core/v1"
	"k8s.io/kubernetes/third_party/forked/golang/expansion"

	"github.com/gpudra/gpudra/devcluster/noderuntime"
)

// imageContainer is what the kubelet and the container runtime know of
// one container of a pod run from the image (pods.go) when they make
// its OCI spec: the pod as the API server has it, the image's config, the
// volumes already set up on the host, the cluster's service variables.
type imageContainer struct {
	Pod       *v1.Pod
	Container *v1.Container
	// Rootfs is the container's root (the image's, writable or not),
	// ImageEnv, ImageUser and ImageWorkingDir the image's config.
	Rootfs          string
	ImageEnv        []string
	ImageUser       string
	ImageWorkingDir string
	// Volumes are the pod's volumes by name: where each is on the host.
	Volumes map[string]string
	// ServiceEnv are the variables the kubelet gives every container
	// (KUBERNETES_SERVICE_HOST and _PORT).
	ServiceEnv []string
	// ExtraMounts come after the volume mounts: the service account
	// token, as the kubelet mounts the projected volume admission adds.
	ExtraMounts []oci.Mount
	Cgroup      string
}

// imageContainerSpec is the OCI spec containerd's CRI plugin would give
// runc for the container: command and args, env (the downward API
// resolved), the user, capabilities and privilege of its securityContext,
// a read-only root where readOnlyRootFilesystem says so, its volume
// mounts, and namespaces of its own (the host's PID namespace with
// hostPID). An error names the pod, the container and the field that
// devcluster cannot honour: nothing is run half-configured.
func imageContainerSpec(in imageContainer) (*oci.Spec, error) {
	pod, c := in.Pod, in.Container
	where := fmt.Sprintf("pod %s/%s container %s", pod.Namespace, pod.Name, c.Name)
	if len(c.Command) == 0 {
		return nil, fmt.Errorf("%s: no command (the image has no entrypoint: every pod names its command)", where)
	}
	env, err := containerEnv(pod, c, in.ImageEnv, in.ServiceEnv)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", where, err)
	}
	// $(VAR) in the command and args, from the container's environment.
	mapping := expansion.MappingFuncFor(envMap(env))
	var args []string
	for _, a := range append(slices.Clone(c.Command), c.Args...) {
		args = append(args, expansion.Expand(a, mapping))
	}
	uid, gid, err := containerUser(pod, c, in.ImageUser)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", where, err)
	}
	sc := c.SecurityContext
	if sc == nil {
		sc = &v1.SecurityContext{}
	}
	privileged := sc.Privileged != nil && *sc.Privileged
	caps := containerCapabilities(sc, privileged)
	cwd := c.WorkingDir
	if cwd == "" {
		cwd = in.ImageWorkingDir
	}
	if cwd == "" {
		cwd = "/"
	}
	s := &oci.Spec{
		Version:  oci.Version,
		Hostname: pod.Name,
		Root:     &oci.Root{Path: in.Rootfs, Readonly: sc.ReadOnlyRootFilesystem != nil && *sc.ReadOnlyRootFilesystem},
		Process: &oci.Process{
			Args: args, Env: env, Cwd: cwd,
			User:         oci.User{UID: uid, GID: gid},
			Capabilities: &oci.LinuxCapabilities{Bounding: caps, Effective: caps, Permitted: caps},
			// allowPrivilegeEscalation defaults to true, as in Kubernetes.
			NoNewPrivileges: !privileged && sc.AllowPrivilegeEscalation != nil && !*sc.AllowPrivilegeEscalation,
		},
		Mounts: []oci.Mount{
			{Destination: "/proc", Type: "proc", Source: "proc"},
			{Destination: "/dev", Type: "tmpfs", Source: "tmpfs", Options: []string{"nosuid", "strictatime", "mode=755", "size=65536k"}},
			{Destination: "/dev/pts", Type: "devpts", Source: "devpts", Options: []string{"nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"}},
			{Destination: "/dev/shm", Type: "tmpfs", Source: "shm", Options: []string{"nosuid", "noexec", "nodev", "mode=1777", "size=65536k"}},
			{Destination: "/dev/mqueue", Type: "mqueue", Source: "mqueue", Options: []string{"nosuid", "noexec", "nodev"}},
			{Destination: "/sys", Type: "sysfs", Source: "sysfs", Options: []string{"nosuid", "noexec", "nodev", map[bool]string{true: "rw", false: "ro"}[privileged]}},
		},
		Linux: &oci.Linux{
			Namespaces:  []oci.LinuxNamespace{{Type: oci.MountNamespace}, {Type: oci.IPCNamespace}, {Type: oci.UTSNamespace}},
			CgroupsPath: in.Cgroup,
			// Privileged: every device; else the default deny (runc adds
			// null, zero, random, tty and the like).
			Resources: &oci.LinuxResources{Devices: []oci.LinuxDeviceCgroup{{Allow: privileged, Access: "rwm"}}},
		},
	}
	if !privileged {
		s.Linux.MaskedPaths = []string{"/proc/kcore", "/proc/keys", "/proc/timer_list", "/sys/firmware"}
		s.Linux.ReadonlyPaths = []string{"/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger"}
	}
	if !pod.Spec.HostPID {
		s.Linux.Namespaces = append(s.Linux.Namespaces, oci.LinuxNamespace{Type: oci.PIDNamespace})
	}
	if !pod.Spec.HostNetwork {
		s.Linux.Namespaces = append(s.Linux.Namespaces, oci.LinuxNamespace{Type: oci.NetworkNamespace})
	}
	for _, m := range c.VolumeMounts {
		src, ok := in.Volumes[m.Name]
		if !ok {
			return nil, fmt.Errorf("%s: volumeMounts %s: the pod has no volume %q", where, m.MountPath, m.Name)
		}
		if m.SubPath != "" {
			src = filepath.Join(src, filepath.Clean("/"+m.SubPath))
		}
		opts := []string{"rbind", "rprivate", "rw"}
		if m.ReadOnly {
			opts[2] = "ro"
		}
		s.Mounts = noderuntime.DeleteMount(s.Mounts, m.MountPath)
		s.Mounts = append(s.Mounts, oci.Mount{Destination: m.MountPath, Type: "bind", Source: src, Options: opts})
	}
	s.Mounts = append(s.Mounts, in.ExtraMounts...)
	return s, nil
}

// containerEnv is the container's environment as the kubelet makes it: the
// image's, then the service variables, then the container's own, the
// downward API's fieldRefs resolved from the pod. A source devcluster's
// kubelet does not resolve (secretKeyRef, configMapKeyRef,
// resourceFieldRef, envFrom) is an error naming the variable.
func containerEnv(pod *v1.Pod, c *v1.Container, image, service []string) ([]string, error) {
	if len(c.EnvFrom) > 0 {
		return nil, fmt.Errorf("envFrom: not supported by devcluster's kubelet")
	}
	env := append(slices.Clone(image), service...)
	set := func(name, value string) {
		env = slices.DeleteFunc(env, func(e string) bool { return strings.HasPrefix(e, name+"=") })
		env = append(env, name+"="+value)
	}
	// A value's $(VAR) is expanded from the service variables and the
	// container's variables defined before it, as the kubelet does (the
	// chart's host paths name $(NODE_NAME)); the image's are not used.
	defined := envMap(service)
	for _, e := range c.Env {
		if e.ValueFrom == nil {
			v := expansion.Expand(e.Value, expansion.MappingFuncFor(defined))
			set(e.Name, v)
			defined[e.Name] = v
			continue
		}
		if e.ValueFrom.FieldRef == nil {
			return nil, fmt.Errorf("env %s: only value and valueFrom.fieldRef are supported by devcluster's kubelet", e.Name)
		}
		v, err := podField(pod, e.ValueFrom.FieldRef.FieldPath)
		if err != nil {
			return nil, fmt.Errorf("env %s: %w", e.Name, err)
		}
		set(e.Name, v)
		defined[e.Name] = v
	}
	return env, nil
}

// envMap is NAME=value entries as a map.
func envMap(env []string) map[string]string {
	m := map[string]string{}
	for _, e := range env {
		if k, v, ok := strings.Cut(e, "="); ok {
			m[k] = v
		}
	}
	return m
}

// podField is a downward API field of the pod.
func podField(pod *v1.Pod, path string) (string, error) {
	switch path {
	case "metadata.name":
		return pod.Name, nil
	case "metadata.namespace":
		return pod.Namespace, nil
	case "metadata.uid":
		return string(pod.UID), nil
	case "spec.nodeName":
		return pod.Spec.NodeName, nil
	case "spec.serviceAccountName":
		return pod.Spec.ServiceAccountName, nil
	case "status.podIP":
		return pod.Status.PodIP, nil
	case "status.hostIP":
		return pod.Status.HostIP, nil
	}
	for prefix, m := range map[string]map[string]string{"metadata.labels": pod.Labels, "metadata.annotations": pod.Annotations} {
		if key, ok := strings.CutPrefix(path, prefix+"['"); ok && strings.HasSuffix(key, "']") {
			return m[strings.TrimSuffix(key, "']")], nil
		}
	}
	return "", fmt.Errorf("fieldRef %q: not a field the downward API gives", path)
}

// containerUser is the container's uid and gid: its securityContext's,
// the pod's, the image's. runAsNonRoot with uid 0 is refused, as the
// kubelet refuses it.
func containerUser(pod *v1.Pod, c *v1.Container, image string) (uint32, uint32, error) {
	var uid, gid *int64
	nonRoot := false
	if psc := pod.Spec.SecurityContext; psc != nil {
		uid, gid = psc.RunAsUser, psc.RunAsGroup
		nonRoot = psc.RunAsNonRoot != nil && *psc.RunAsNonRoot
	}
	if sc := c.SecurityContext; sc != nil {
		if sc.RunAsUser != nil {
			uid = sc.RunAsUser
		}
		if sc.RunAsGroup != nil {
			gid = sc.RunAsGroup
		}
		if sc.RunAsNonRoot != nil {
			nonRoot = *sc.RunAsNonRoot
		}
	}
	imgUID, imgGID, err := parseImageUser(image)
	if err != nil {
		return 0, 0, err
	}
	u, g := imgUID, imgGID
	if uid != nil {
		u = uint32(*uid) //nolint:gosec // validated by the API server: 0..2^31-1
		if gid == nil {
			g = u
		}
	}
	if gid != nil {
		g = uint32(*gid) //nolint:gosec // as above
	}
	if nonRoot && u == 0 {
		return 0, 0, fmt.Errorf("securityContext: runAsNonRoot and the container would run as root (uid 0)")
	}
	return u, g, nil
}

// parseImageUser reads an image config's numeric "uid[:gid]".
func parseImageUser(user string) (uint32, uint32, error) {
	if user == "" {
		return 0, 0, nil
	}
	us, gs, hasGroup := strings.Cut(user, ":")
	u, err := strconv.ParseUint(us, 10, 32)
	if err != nil {
		return 0, 0, fmt.Errorf("the image's user %q: devcluster resolves numeric users only", user)
	}
	g := u
	if hasGroup {
		if g, err = strconv.ParseUint(gs, 10, 32); err != nil {
			return 0, 0, fmt.Errorf("the image's group %q: devcluster resolves numeric groups only", user)
		}
	}
	return uint32(u), uint32(g), nil
}

// containerCapabilities: every capability when privileged; else
// containerd's default set with the securityContext's drop (ALL too) and
// add.
func containerCapabilities(sc *v1.SecurityContext, privileged bool) []string {
	if privileged {
		return noderuntime.PrivilegedCapabilities()
	}
	caps := slices.Clone(noderuntime.DefaultCapabilities)
	if sc.Capabilities == nil {
		return caps
	}
	for _, d := range sc.Capabilities.Drop {
		if strings.EqualFold(string(d), "ALL") {
			caps = nil
			break
		}
		caps = slices.DeleteFunc(caps, func(c string) bool { return c == capName(d) })
	}
	for _, a := range sc.Capabilities.Add {
		if !slices.Contains(caps, capName(a)) {
			caps = append(caps, capName(a))
		}
	}
	return caps
}

func capName(c v1.Capability) string {
	s := strings.ToUpper(string(c))
	if !strings.HasPrefix(s, "CAP_") {
		s = "CAP_" + s
	}
	return s
}
