package plugin

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"

	oci "github.com/opencontainers/runtime-spec/specs-go"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
)

// hostBackend is the simulator with other host facts, to tell that the
// plugin takes them from its backend and from nowhere else.
type hostBackend struct {
	*sim.Machine
	host nvdevice.Host
	err  error
}

func (b hostBackend) Host(context.Context) (nvdevice.Host, error) { return b.host, b.err }

// startOver starts the plugin over backend with claims in a fake API.
func startOver(t *testing.T, e *env, backend nvdevice.Interface, claims ...*resourceapi.ResourceClaim) (*testKubelet, error) {
	t.Helper()
	// Unix socket paths are limited to 108 bytes: keep them short.
	sockets, err := os.MkdirTemp("", "gpudra")
	require.NoError(t, err)
	t.Cleanup(func() { os.RemoveAll(sockets) })
	client := fakeClient(&v1.Node{ObjectMeta: metav1.ObjectMeta{Name: pool, UID: "node-uid"}})
	for _, c := range claims {
		_, err := client.ResourceV1().ResourceClaims(c.Namespace).Create(context.Background(), c, metav1.CreateOptions{})
		require.NoError(t, err)
	}
	ctx, cancel := context.WithCancelCause(context.Background())
	t.Cleanup(func() { cancel(nil) })
	p, err := Start(ctx, Config{NodeName: pool, Backend: backend, Client: client, RegistrarDir: filepath.Join(sockets, "reg"),
		PluginDataDir: filepath.Join(sockets, "data"), CDIDir: e.cdiDir, BootID: "boot-1"}, cancel)
	if err != nil {
		return nil, err
	}
	t.Cleanup(p.Stop)
	return registerPlugin(t, filepath.Join(sockets, "reg")), nil
}

// TestStartTakesHostFactsFromTheBackend: the device majors, the capability
// minors and the compute policy in a prepared claim are the backend's Host.
func TestStartTakesHostFactsFromTheBackend(t *testing.T) {
	e := newEnv(t)
	var asked []string
	backend := hostBackend{Machine: e.machine, host: nvdevice.Host{
		Majors: nvdevice.DeviceMajors{NVIDIA: 195, UVM: 400, Caps: 401},
		CapMinors: func(gpuMinor, gi, ci int) (int, int, error) {
			asked = append(asked, fmt.Sprintf("gpu%d/gi%d/ci%d", gpuMinor, gi, ci))
			return 1000 + gi, 2000 + ci, nil
		},
		// No compute policy: time-sliced claims are refused.
	}}
	mig := claim("mig", []string{"gpu-0-mig-1g-10gb-6"})
	ts := claim("ts", []string{"gpu-4"}, timeSliced)
	kubelet, err := startOver(t, e, backend, mig, ts)
	require.NoError(t, err)
	resp, err := kubelet.dra.NodePrepareResources(context.Background(), &drapb.NodePrepareResourcesRequest{Claims: []*drapb.Claim{
		{Namespace: mig.Namespace, Name: mig.Name, Uid: string(mig.UID)},
		{Namespace: ts.Namespace, Name: ts.Name, Uid: string(ts.UID)},
	}})
	require.NoError(t, err)

	require.Empty(t, resp.Claims["mig"].Error)
	migs := e.migDevices()
	require.Len(t, migs, 1)
	gi := migs[0].GPUInstanceID
	assert.Equal(t, []string{fmt.Sprintf("gpu0/gi%d/ci%d", gi, migs[0].ComputeInstanceID)}, asked)
	spec := inject(t, e.cdiDir, resp.Claims["mig"].Devices[0].CdiDeviceIds)
	assert.ElementsMatch(t, []oci.LinuxDevice{
		{Path: "/dev/nvidiactl", Type: "c", Major: 195, Minor: 255},
		{Path: "/dev/nvidia-uvm", Type: "c", Major: 400, Minor: 0},
		{Path: "/dev/nvidia-uvm-tools", Type: "c", Major: 400, Minor: 1},
		{Path: "/dev/nvidia0", Type: "c", Major: 195, Minor: 0},
		{Path: fmt.Sprintf("/dev/nvidia-caps/nvidia-cap%d", 1000+gi), Type: "c", Major: 401, Minor: int64(1000 + gi)},
		{Path: fmt.Sprintf("/dev/nvidia-caps/nvidia-cap%d", 2000+migs[0].ComputeInstanceID), Type: "c", Major: 401, Minor: int64(2000 + migs[0].ComputeInstanceID)},
	}, devicesOf(spec))

	assert.Contains(t, resp.Claims["ts"].Error, "this node cannot set time slices (no compute policy backend)")
}

// devicesOf are the spec's device nodes without the fields the test does
// not set (file mode, owner).
func devicesOf(spec *oci.Spec) []oci.LinuxDevice {
	var out []oci.LinuxDevice
	for _, d := range spec.Linux.Devices {
		out = append(out, oci.LinuxDevice{Path: d.Path, Type: d.Type, Major: d.Major, Minor: d.Minor})
	}
	return out
}

func TestStartFailsWithoutHostFacts(t *testing.T) {
	errNoUVM := errors.New("device majors from /proc/devices: no nvidia-uvm entry")
	for _, tc := range []struct {
		name string
		b    hostBackend
		want string
	}{
		{name: "the backend cannot tell", b: hostBackend{err: errNoUVM},
			want: "host facts from the GPU backend: device majors from /proc/devices: no nvidia-uvm entry"},
		{name: "no capability minors", b: hostBackend{host: nvdevice.Host{Majors: sim.Majors}},
			want: "host facts from the GPU backend: no MIG capability minors"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			tc.b.Machine = e.machine
			_, err := startOver(t, e, tc.b)
			require.EqualError(t, err, tc.want)
			if tc.b.err != nil {
				require.ErrorIs(t, err, tc.b.err)
			}
			assert.Empty(t, e.cdiSpecs())
		})
	}
}
