package noderuntime

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"golang.org/x/sys/unix"
	kubecontainer "k8s.io/kubernetes/pkg/kubelet/container"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/probe"
)

// ContainerView is what a container would get from its CDI devices: the
// runtime's view after the CDI library edited the OCI spec.
type ContainerView struct {
	CDIDevices  []string          `json:"cdiDevices,omitempty"`
	Env         map[string]string `json:"env,omitempty"`
	DeviceNodes []string          `json:"deviceNodes,omitempty"`
	// Mounts are the claims' own mounts (sharing directories); the
	// driver's files, from the node's common driver spec, are DriverMounts
	// ("source:destination:options").
	Mounts       []string `json:"mounts,omitempty"`
	DriverMounts []string `json:"driverMounts,omitempty"`
	// GPUs are the UUIDs of the GPUs and MIG devices the container's
	// device nodes give it (what CUDA would enumerate), named through the
	// node's inventory; no environment variable is read for them.
	GPUs []string `json:"gpus,omitempty"`
	// Conflicts are the variables and mount points that two of the
	// container's CDI devices set differently: a runtime applies them in
	// the kubelet's order and the last one wins, so what the container
	// gets would depend on that order.
	Conflicts []string `json:"conflicts,omitempty"`
	// Report is what the container's probe saw from inside, where the
	// node runs real containers (OCIRuntime); nil where the spec was only
	// resolved.
	Report *probe.Report `json:"report,omitempty"`
}

// VisibleGPUs are the GPU and MIG UUIDs the container sees: computed from
// its device nodes.
func (v ContainerView) VisibleGPUs() []string { return v.GPUs }

// DeviceIdentifier names the GPUs and MIG devices that a container's device
// nodes give it.
type DeviceIdentifier func(nodes []oci.LinuxDevice) ([]string, error)

// MachineDevices identifies device nodes through a simulated machine: a GPU
// is seen when its /dev/nvidia<minor> is there; a MIG device when, besides
// its parent's node, both its capability nodes
// (/dev/nvidia-caps/nvidia-cap<N> of its GPU instance and compute instance)
// are. A GPU whose node is there but none of whose MIG devices is (a whole
// GPU, or the monitoring view of one in MIG mode) is seen as the GPU.
// Nodes are matched by type, major and minor, as the kernel does.
func MachineDevices(m *sim.Machine) DeviceIdentifier {
	return func(nodes []oci.LinuxDevice) ([]string, error) {
		host, err := m.Host(context.Background())
		if err != nil {
			return nil, err
		}
		// Not the inventory: read faults injected into the machine's
		// NVML must not fail the kubelet's view.
		return identify(m.Devices(), host, nodes), nil
	}
}

// BackendDevices is MachineDevices through any backend's inventory and
// host facts (NVML on a real GPU).
func BackendDevices(b nvdevice.Interface) DeviceIdentifier {
	return func(nodes []oci.LinuxDevice) ([]string, error) {
		ctx := context.Background()
		host, err := b.Host(ctx)
		if err != nil {
			return nil, err
		}
		inv, err := b.Inventory(ctx)
		if err != nil {
			return nil, err
		}
		return identify(inv.GPUs, host, nodes), nil
	}
}

// HostDevicesUnder stats device nodes for real under root (a host's /, or
// a simulated machine's directory holding its dev/): what a runtime reads
// of a DeviceSpec's host path.
func HostDevicesUnder(root string) HostDevice {
	return func(path string) (oci.LinuxDevice, error) {
		var st unix.Stat_t
		if err := unix.Stat(filepath.Join(root, path), &st); err != nil {
			return oci.LinuxDevice{}, fmt.Errorf("stat %s: %w", path, err)
		}
		typ := ""
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFCHR:
			typ = "c"
		case unix.S_IFBLK:
			typ = "b"
		default:
			return oci.LinuxDevice{}, fmt.Errorf("%s is not a device node", path)
		}
		return oci.LinuxDevice{Path: path, Type: typ, Major: int64(unix.Major(st.Rdev)), Minor: int64(unix.Minor(st.Rdev))}, nil
	}
}

// MachineHostDevices is the simulated machine's /dev as a runtime stats it
// for a DeviceSpec: /dev/nvidiactl, /dev/nvidia-uvm, /dev/nvidia-uvm-tools,
// /dev/nvidia<minor> of each of its GPUs, and the MIG capability nodes
// /dev/nvidia-caps/nvidia-cap<N>, with the machine's majors. Any other path
// does not exist.
func MachineHostDevices(m *sim.Machine) HostDevice {
	return func(path string) (oci.LinuxDevice, error) {
		host, err := m.Host(context.Background())
		if err != nil {
			return oci.LinuxDevice{}, err
		}
		node := func(major, minor int64) (oci.LinuxDevice, error) {
			return oci.LinuxDevice{Path: path, Type: "c", Major: major, Minor: minor}, nil
		}
		switch path {
		case "/dev/nvidiactl":
			return node(host.Majors.NVIDIA, 255)
		case "/dev/nvidia-uvm":
			return node(host.Majors.UVM, 0)
		case "/dev/nvidia-uvm-tools":
			return node(host.Majors.UVM, 1)
		}
		if n, ok := strings.CutPrefix(path, "/dev/nvidia-caps/nvidia-cap"); ok {
			if minor, err := strconv.ParseInt(n, 10, 64); err == nil && minor >= 0 {
				return node(host.Majors.Caps, minor)
			}
		}
		if n, ok := strings.CutPrefix(path, "/dev/nvidia"); ok {
			for _, g := range m.Devices() {
				if strconv.Itoa(g.Minor) == n {
					return node(host.Majors.NVIDIA, int64(g.Minor))
				}
			}
		}
		return oci.LinuxDevice{}, fmt.Errorf("stat %s: %w", path, os.ErrNotExist)
	}
}

func identify(gpus []nvdevice.GPU, host nvdevice.Host, nodes []oci.LinuxDevice) []string {
	gpuMinors, capMinors := map[int64]bool{}, map[int64]bool{}
	for _, n := range nodes {
		if n.Type != "c" {
			continue
		}
		switch n.Major {
		case host.Majors.NVIDIA:
			gpuMinors[n.Minor] = true
		case host.Majors.Caps:
			capMinors[n.Minor] = true
		}
	}
	sort.Slice(gpus, func(i, j int) bool { return gpus[i].Index < gpus[j].Index })
	var out []string
	for _, g := range gpus {
		if !gpuMinors[int64(g.Minor)] {
			continue
		}
		migs := append([]nvdevice.MigDevice(nil), g.MIG.Devices...)
		sort.Slice(migs, func(i, j int) bool { return migs[i].Placement.Start < migs[j].Placement.Start })
		var seen []string
		for _, d := range migs {
			gi, ci, err := host.CapMinors(g.Minor, d.GPUInstanceID, d.ComputeInstanceID)
			if err == nil && capMinors[int64(gi)] && capMinors[int64(ci)] {
				seen = append(seen, d.UUID)
			}
		}
		if len(seen) == 0 {
			seen = []string{g.UUID}
		}
		out = append(out, seen...)
	}
	return out
}

// ResolveCDI injects the named CDI devices from the specs in cdiDir into an
// empty OCI spec, exactly as a CDI-enabled container runtime does, and
// names the GPUs its device nodes give (identify may be nil: none named).
func ResolveCDI(cdiDir string, ids []string, identify DeviceIdentifier) (ContainerView, error) {
	return ResolveContainer(cdiDir, RuntimeEdits{CDIDevices: ids}, identify, nil)
}

// RuntimeEdits are what the kubelet hands the container runtime for one
// container: CDI device names (DRA's, and a device plugin's CdiDevices or
// cdi.k8s.io annotations), and a device plugin's own device nodes, mounts
// and variables, which any runtime applies, CDI or not.
type RuntimeEdits struct {
	CDIDevices []string
	Devices    []kubecontainer.DeviceInfo
	Mounts     []kubecontainer.Mount
	Envs       []kubecontainer.EnvVar
}

// HostDevice is what a runtime reads of a device node on the host (type,
// major, minor) when a DeviceSpec names it; an error if there is none.
type HostDevice func(path string) (oci.LinuxDevice, error)

// ResolveContainer builds the container's OCI spec as containerd's CRI
// plugin does: the kubelet's devices (each host path stat'ed through dev,
// a device cgroup rule with the given permissions), bind mounts and
// variables first, then the CDI devices injected by the CDI library.
func ResolveContainer(cdiDir string, edits RuntimeEdits, identify DeviceIdentifier, dev HostDevice) (ContainerView, error) {
	view, _, err := resolveContainer(cdiDir, edits, identify, dev)
	return view, err
}

// ResolveContainerSpec is ResolveContainer that also returns the OCI spec,
// for a runtime to run.
func ResolveContainerSpec(cdiDir string, edits RuntimeEdits, identify DeviceIdentifier, dev HostDevice) (ContainerView, *oci.Spec, error) {
	return resolveContainer(cdiDir, edits, identify, dev)
}

func resolveContainer(cdiDir string, edits RuntimeEdits, identify DeviceIdentifier, dev HostDevice) (ContainerView, *oci.Spec, error) {
	ids := edits.CDIDevices
	view := ContainerView{CDIDevices: ids}
	spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{Resources: &oci.LinuxResources{}}}
	if len(ids) == 0 && len(edits.Devices) == 0 && len(edits.Mounts) == 0 && len(edits.Envs) == 0 {
		return view, spec, nil
	}
	for _, d := range edits.Devices {
		if dev == nil {
			return view, nil, fmt.Errorf("device %s: this node's runtime cannot stat host devices", d.PathOnHost)
		}
		n, err := dev(d.PathOnHost)
		if err != nil {
			// containerd fails the container.
			return view, nil, fmt.Errorf("device %s: %w", d.PathOnHost, err)
		}
		n.Path = d.PathInContainer
		spec.Linux.Devices = append(spec.Linux.Devices, n)
		spec.Linux.Resources.Devices = append(spec.Linux.Resources.Devices, oci.LinuxDeviceCgroup{
			Allow: true, Type: n.Type, Major: &n.Major, Minor: &n.Minor, Access: d.Permissions})
	}
	for _, m := range edits.Mounts {
		opt := "rw"
		if m.ReadOnly {
			opt = "ro"
		}
		spec.Mounts = append(spec.Mounts, oci.Mount{Source: m.HostPath, Destination: m.ContainerPath, Type: "bind", Options: []string{"rbind", "rprivate", opt}})
	}
	for _, e := range edits.Envs {
		spec.Process.Env = append(spec.Process.Env, e.Name+"="+e.Value)
	}
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(cdiDir), cdiapi.WithAutoRefresh(false))
	if err != nil {
		return view, nil, fmt.Errorf("CDI cache: %w", err)
	}
	if len(ids) > 0 {
		if unresolved, err := cache.InjectDevices(spec, ids...); err != nil {
			return view, nil, fmt.Errorf("CDI injection (unresolved %v): %w", unresolved, err)
		}
	}
	view.Env = map[string]string{}
	for _, kv := range spec.Process.Env {
		k, v, _ := strings.Cut(kv, "=")
		view.Env[k] = v
	}
	for _, d := range spec.Linux.Devices {
		view.DeviceNodes = append(view.DeviceNodes, d.Path)
	}
	driver, err := driverMounts(cache, ids)
	if err != nil {
		return view, nil, err
	}
	for _, m := range spec.Mounts {
		if driver[m.Source+":"+m.Destination] {
			view.DriverMounts = append(view.DriverMounts, m.Source+":"+m.Destination+":"+strings.Join(m.Options, ","))
			continue
		}
		view.Mounts = append(view.Mounts, m.Source+":"+m.Destination)
	}
	sort.Strings(view.DeviceNodes)
	sort.Strings(view.Mounts)
	sort.Strings(view.DriverMounts)
	if view.Conflicts, err = conflicts(cache, ids); err != nil {
		return view, nil, err
	}
	if identify != nil {
		if view.GPUs, err = identify(spec.Linux.Devices); err != nil {
			return view, nil, fmt.Errorf("name the container's GPUs: %w", err)
		}
	}
	return view, spec, nil
}

// conflicts injects each CDI device alone and lists the variables and
// mount points two of them set to different values.
func conflicts(cache *cdiapi.Cache, ids []string) ([]string, error) {
	env, mounts := map[string]string{}, map[string]string{}
	found := map[string]bool{}
	for _, id := range ids {
		spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
		if _, err := cache.InjectDevices(spec, id); err != nil {
			return nil, fmt.Errorf("CDI injection of %s: %w", id, err)
		}
		for _, kv := range spec.Process.Env {
			k, v, _ := strings.Cut(kv, "=")
			if old, ok := env[k]; ok && old != v {
				found["env "+k] = true
			}
			env[k] = v
		}
		for _, m := range spec.Mounts {
			if old, ok := mounts[m.Destination]; ok && old != m.Source {
				found["mount "+m.Destination] = true
			}
			mounts[m.Destination] = m.Source
		}
	}
	out := make([]string, 0, len(found))
	for k := range found {
		out = append(out, k)
	}
	sort.Strings(out)
	return out, nil
}

// driverMounts are the mounts the node's common driver device gives: the
// driver's files, whether the container got them through that CDI device
// or as a device plugin's mounts (when the node has such a spec).
func driverMounts(cache *cdiapi.Cache, ids []string) (map[string]bool, error) {
	out := map[string]bool{}
	if !slices.Contains(ids, cdi.DriverDeviceID) && cache.GetDevice(cdi.DriverDeviceID) == nil {
		return out, nil
	}
	spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{}}
	if _, err := cache.InjectDevices(spec, cdi.DriverDeviceID); err != nil {
		return nil, fmt.Errorf("CDI injection of the driver device: %w", err)
	}
	for _, m := range spec.Mounts {
		out[m.Source+":"+m.Destination] = true
	}
	return out, nil
}
