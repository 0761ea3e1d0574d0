package deviceplugin

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"testing"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/require"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"

	"github.com/gpudra/gpudra/pkg/cdi"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/prepared"
	"github.com/gpudra/gpudra/pkg/sharing"
)

// specDir writes the device plugin's node-wide CDI spec of inv into a new
// CDI directory; m gives the host (nil: the simulator's majors, no MIG).
func specDir(t *testing.T, m *sim.Machine, inv *nvdevice.Inventory) string {
	t.Helper()
	host := nvdevice.Host{Majors: sim.Majors}
	if m != nil {
		var err error
		host, err = m.Host(context.Background())
		require.NoError(t, err)
	}
	dir := t.TempDir()
	w, err := cdi.NewWriter(dir)
	require.NoError(t, err)
	require.NoError(t, WriteCDISpec(w, inv, host))
	return dir
}

// writeDriverSpec lays out the simulated driver's files and writes the
// driver's common spec into dir as the agent does (hook: --nvidia-cdi-hook).
func writeDriverSpec(t *testing.T, m *sim.Machine, dir, hook string) []string {
	t.Helper()
	root := t.TempDir()
	require.NoError(t, sim.WriteDriverRoot(root, m.DriverVersion()))
	m.SetDriverRoot(root)
	files, err := m.DriverFiles(context.Background())
	require.NoError(t, err)
	spec, err := cdi.BuildDriverSpec(files, cdi.DriverOptions{HookPath: hook})
	require.NoError(t, err)
	w, err := cdi.NewWriter(dir)
	require.NoError(t, err)
	require.NoError(t, w.WriteDriver(spec))
	return []string{cdi.DriverDeviceID}
}

// writeMPSSpec writes GPU gpu's MPS spec as startMPS does, with a server's
// pipe directory and /dev/shm and the replica's limits.
func writeMPSSpec(t *testing.T, m *sim.Machine, inv *nvdevice.Inventory, dir, gpu string) {
	t.Helper()
	host, err := m.Host(context.Background())
	require.NoError(t, err)
	devices, err := specDevices(inv, host)
	require.NoError(t, err)
	i := slices.IndexFunc(devices, func(d prepared.Device) bool { return d.Device == gpu })
	require.GreaterOrEqual(t, i, 0)
	server := t.TempDir()
	edits := sharing.Edits{
		Env: map[string]string{"CUDA_MPS_PIPE_DIRECTORY": sharing.MPSPipeDirectory, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"},
		Mounts: []sharing.Mount{{HostPath: filepath.Join(server, "pipe"), ContainerPath: sharing.MPSPipeDirectory},
			{HostPath: filepath.Join(server, "shm"), ContainerPath: "/dev/shm"}},
	}
	spec, err := BuildMPSCDISpec(devices[i], edits, host.Majors)
	require.NoError(t, err)
	w, err := cdi.NewWriter(dir)
	require.NoError(t, err)
	require.NoError(t, w.Write(MPSSpecUID(gpu), spec))
}

// hostNode is what a runtime reads from a device node on the host: the
// simulator makes no device files, so the host's /dev is the NVIDIA
// driver's numbering with the simulator's majors (nvidia<minor> and
// nvidiactl on 195, the UVM nodes, nvidia-caps/nvidia-cap<minor>), under
// devRoot.
func hostNode(devRoot string) func(string) (oci.LinuxDevice, error) {
	gpu := regexp.MustCompile(`^/dev/nvidia([0-9]+)$`)
	capNode := regexp.MustCompile(`^/dev/nvidia-caps/nvidia-cap([0-9]+)$`)
	return func(hostPath string) (oci.LinuxDevice, error) {
		p := hostPath
		if devRoot != "" && devRoot != "/" {
			if !strings.HasPrefix(p, devRoot+"/") {
				return oci.LinuxDevice{}, fmt.Errorf("%s is not under the dev root %s", p, devRoot)
			}
			p = strings.TrimPrefix(p, devRoot)
		}
		dev := func(major, minor int64) (oci.LinuxDevice, error) {
			return oci.LinuxDevice{Path: p, Type: "c", Major: major, Minor: minor}, nil
		}
		switch {
		case p == "/dev/nvidiactl":
			return dev(sim.Majors.NVIDIA, 255)
		case p == "/dev/nvidia-uvm":
			return dev(sim.Majors.UVM, 0)
		case p == "/dev/nvidia-uvm-tools":
			return dev(sim.Majors.UVM, 1)
		case gpu.MatchString(p):
			n, _ := strconv.ParseInt(gpu.FindStringSubmatch(p)[1], 10, 64)
			return dev(sim.Majors.NVIDIA, n)
		case capNode.MatchString(p):
			n, _ := strconv.ParseInt(capNode.FindStringSubmatch(p)[1], 10, 64)
			return dev(sim.Majors.Caps, n)
		}
		return oci.LinuxDevice{}, fmt.Errorf("stat %s: %w", hostPath, os.ErrNotExist)
	}
}

// runtimeSpec is the OCI spec the kubelet and containerd's CRI build from
// a container's Allocate responses (one per resource) on a runtime without
// CDI: the kubelet keeps the first device, mount and variable of each
// container path or name (devicemanager's deviceRunContainerOptions);
// containerd sets the variables, bind-mounts each mount, and for each
// device reads type, major and minor from the host path and appends the
// device and an allow rule with the DeviceSpec's permissions (WithDevices).
func runtimeSpec(t *testing.T, resps []*pluginapi.ContainerAllocateResponse, stat func(string) (oci.LinuxDevice, error)) *oci.Spec {
	t.Helper()
	spec := &oci.Spec{Process: &oci.Process{}, Linux: &oci.Linux{Resources: &oci.LinuxResources{}}}
	devs, mounts, envs := map[string]bool{}, map[string]bool{}, map[string]bool{}
	for _, r := range resps {
		keys := make([]string, 0, len(r.Envs))
		for k := range r.Envs {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			if !envs[k] {
				envs[k] = true
				spec.Process.Env = append(spec.Process.Env, k+"="+r.Envs[k])
			}
		}
		for _, d := range r.Devices {
			if devs[d.ContainerPath] {
				continue
			}
			devs[d.ContainerPath] = true
			node, err := stat(d.HostPath)
			require.NoError(t, err, "the runtime reads the host's node %s", d.HostPath)
			node.Path = d.ContainerPath
			spec.Linux.Devices = append(spec.Linux.Devices, node)
			major, minor := node.Major, node.Minor
			spec.Linux.Resources.Devices = append(spec.Linux.Resources.Devices,
				oci.LinuxDeviceCgroup{Allow: true, Type: node.Type, Major: &major, Minor: &minor, Access: d.Permissions})
		}
		for _, m := range r.Mounts {
			if mounts[m.ContainerPath] {
				continue
			}
			mounts[m.ContainerPath] = true
			opts := []string{"rbind", "rprivate", "rw"}
			if m.ReadOnly {
				opts[2] = "ro"
			}
			spec.Mounts = append(spec.Mounts, oci.Mount{Source: m.HostPath, Destination: m.ContainerPath, Type: "bind", Options: opts})
		}
	}
	return spec
}

// containerView is what a container sees of an OCI spec, for comparing.
type containerView struct {
	Devices map[string]string // path -> "c 195:3"
	Rules   []string          // "c 195:3 rwm", once each
	Env     map[string]string
	Mounts  map[string]string // destination -> "source ro|rw"
}

// viewOf reads the view, failing on a doubled device path or mount
// destination (cgroup rules may repeat: an allow rule twice is one rule).
func viewOf(t *testing.T, spec *oci.Spec) containerView {
	t.Helper()
	v := containerView{Devices: map[string]string{}, Env: map[string]string{}, Mounts: map[string]string{}}
	for _, d := range spec.Linux.Devices {
		require.NotContains(t, v.Devices, d.Path, "device %s twice", d.Path)
		v.Devices[d.Path] = fmt.Sprintf("%s %d:%d", d.Type, d.Major, d.Minor)
	}
	if spec.Linux.Resources != nil {
		for _, r := range spec.Linux.Resources.Devices {
			require.True(t, r.Allow)
			rule := fmt.Sprintf("%s %d:%d %s", r.Type, *r.Major, *r.Minor, r.Access)
			if !slices.Contains(v.Rules, rule) {
				v.Rules = append(v.Rules, rule)
			}
		}
	}
	sort.Strings(v.Rules)
	for _, e := range spec.Process.Env {
		k, val, _ := strings.Cut(e, "=")
		v.Env[k] = val
	}
	for _, m := range spec.Mounts {
		require.NotContains(t, v.Mounts, m.Destination, "mount %s twice", m.Destination)
		mode := "rw"
		if slices.Contains(m.Options, "ro") {
			mode = "ro"
		}
		v.Mounts[m.Destination] = m.Source + " " + mode
	}
	return v
}

// injectCDI applies CDI names to spec with the CDI library over dir, as a
// CDI-enabled runtime does after the kubelet's devices, mounts and
// variables.
func injectCDI(t *testing.T, dir string, spec *oci.Spec, names []string) {
	t.Helper()
	cache, err := cdiapi.NewCache(cdiapi.WithSpecDirs(dir), cdiapi.WithAutoRefresh(false))
	require.NoError(t, err)
	require.NoError(t, cache.Refresh())
	unresolved, err := cache.InjectDevices(spec, names...)
	require.NoError(t, err, "unresolved: %v", unresolved)
}
