package deviceplugin

// The CDI-free answer. A runtime without CDI (containerd 1.7 without
// enable_cdi, CRI-O without CDI directories) ignores the CDI names Allocate
// can send, and a node without NVIDIA's container runtime ignores
// NVIDIA_VISIBLE_DEVICES. For the container to get its GPUs anyway, Allocate
// also answers with the container edits themselves, in the device plugin
// API's terms: DeviceSpecs, Mounts and Envs, which the kubelet hands to any
// runtime. They are not a second description of the devices: they are the
// CDI specs' own edits (the node-wide spec, the MPS specs, the driver's
// spec), resolved by the CDI library exactly as a CDI-enabled runtime
// resolves the names, then converted.
//
//   - linux.devices -> DeviceSpec{ContainerPath, HostPath: under
//     flags.nvidiaDevRoot (NVIDIA's rule), Permissions: the access of the
//     cgroup rule CDI adds for it (the spec's, "rwm" by default)}; the
//     runtime reads type, major and minor from the host path, so the host
//     must have the node.
//   - mounts -> Mount{ContainerPath, HostPath, ReadOnly: "ro"}; only bind
//     mounts can be passed.
//   - process.env -> Envs.
//   - hooks cannot be passed (the API has none): the driver spec's hooks
//     (--nvidia-cdi-hook) are lost on this path, which is why they are
//     off by default (the driver's libraries are then mounted under their
//     sonames too, so the CDI-free answer carries everything).

import (
	"fmt"
	"os"
	"slices"
	"strings"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"
	cdispec "tags.cncf.io/container-device-interface/specs-go"
)

// ContainerEdits are CDI container edits in the device plugin API's terms.
type ContainerEdits struct {
	Devices []*pluginapi.DeviceSpec
	Mounts  []*pluginapi.Mount
	Envs    map[string]string
	// Hooks counts the hooks of the CDI edits, which the device plugin
	// API cannot carry.
	Hooks int
}

// cdiResolver resolves CDI names in one CDI directory, with the CDI
// library, as a CDI-enabled runtime does.
type cdiResolver struct {
	dir   string
	cache *cdiapi.Cache
}

// newCDIResolver reads the specs in dir once: the device plugin's specs
// are written before the plugins start and do not change while they run.
func newCDIResolver(dir string) (*cdiResolver, error) {
	if _, err := os.Stat(dir); err != nil {
		return nil, fmt.Errorf("CDI directory: %w", err)
	}
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(dir), cdiapi.WithAutoRefresh(false))
	if err != nil {
		return nil, fmt.Errorf("CDI cache over %s: %w", dir, err)
	}
	// Errors of other specs in the directory do not stop ours from
	// resolving (a runtime ignores them too); one of ours that does not
	// resolve is an error of its name.
	_ = cache.Refresh()
	return &cdiResolver{dir: dir, cache: cache}, nil
}

// Inject applies the CDI devices' edits to spec, as a CDI-enabled runtime
// does.
func (r *cdiResolver) Inject(spec *oci.Spec, names ...string) error {
	if unresolved, err := r.cache.InjectDevices(spec, names...); err != nil {
		return fmt.Errorf("CDI devices %s in %s (unresolved: %v): %w", strings.Join(names, ", "), r.dir, unresolved, err)
	}
	return nil
}

// Edits are the edits a container given the CDI devices names gets, in the
// device plugin API's terms, with device nodes on the host under resp's
// DevRoot.
func (r *cdiResolver) Edits(resp Response, names ...string) (ContainerEdits, error) {
	spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
	if err := r.Inject(spec, names...); err != nil {
		return ContainerEdits{}, err
	}
	return editsFromOCI(spec, r.hostPaths(names), resp)
}

// hostPaths are the device nodes whose CDI spec names a host path of its
// own (gpudra's specs do not: the node is at its path on the host).
func (r *cdiResolver) hostPaths(names []string) map[string]string {
	out := map[string]string{}
	add := func(e cdispec.ContainerEdits) {
		for _, n := range e.DeviceNodes {
			if n.HostPath != "" && n.HostPath != n.Path {
				out[n.Path] = n.HostPath
			}
		}
	}
	for _, name := range names {
		if d := r.cache.GetDevice(name); d != nil {
			add(d.ContainerEdits)
			add(d.GetSpec().ContainerEdits)
		}
	}
	return out
}

// editsFromOCI converts the result of CDI injection into an empty spec.
func editsFromOCI(spec *oci.Spec, hostPaths map[string]string, resp Response) (ContainerEdits, error) {
	out := ContainerEdits{Envs: map[string]string{}}
	var rules []oci.LinuxDeviceCgroup
	if spec.Linux.Resources != nil {
		rules = spec.Linux.Resources.Devices
	}
	for _, d := range spec.Linux.Devices {
		host, ok := hostPaths[d.Path]
		if !ok {
			host = resp.hostPath(d.Path)
		}
		out.Devices = append(out.Devices, &pluginapi.DeviceSpec{ContainerPath: d.Path, HostPath: host, Permissions: access(rules, d)})
	}
	for _, m := range spec.Mounts {
		if m.Type != "" && m.Type != "bind" {
			return ContainerEdits{}, fmt.Errorf("mount %s (type %s) cannot be passed through the device plugin API", m.Destination, m.Type)
		}
		out.Mounts = append(out.Mounts, &pluginapi.Mount{ContainerPath: m.Destination, HostPath: m.Source, ReadOnly: slices.Contains(m.Options, "ro")})
	}
	for _, e := range spec.Process.Env {
		k, v, _ := strings.Cut(e, "=")
		out.Envs[k] = v
	}
	if spec.Hooks != nil {
		h := spec.Hooks
		//nolint:staticcheck // Prestart is deprecated but still a hook.
		out.Hooks = len(h.Prestart) + len(h.CreateRuntime) + len(h.CreateContainer) + len(h.StartContainer) + len(h.Poststart) + len(h.Poststop)
	}
	return out, nil
}

// access is the access the cgroup rules give the device: the runtime adds
// the same rule for a DeviceSpec with these permissions.
func access(rules []oci.LinuxDeviceCgroup, d oci.LinuxDevice) string {
	for i := len(rules) - 1; i >= 0; i-- {
		r := rules[i]
		if r.Allow && r.Type == d.Type && r.Major != nil && *r.Major == d.Major && r.Minor != nil && *r.Minor == d.Minor {
			return r.Access
		}
	}
	return "rwm"
}
