package scalebench

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"regexp"
	"sync"

	v1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/utils/ptr"

	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// poolLabel puts a node in the pool of the gangs of one point
// ("gang-<nodes>") or in the general pool, where the other workloads go: a
// gang of 8-GPU pods needs whole free nodes, which pods spread by the
// scheduler over every node would never leave.
const (
	poolLabel   = "scale.gpudra.dev/pool"
	poolGeneral = "general"
)

// mix is what each node of a mix publishes.
type mix struct {
	name string
	// machine is the simulated machine (nil for plain), layout says what
	// MIG devices exist on it.
	machine *sim.MachineSpec
	layout  string
	policy  slicebuilder.MigPolicy
	// What the probe node publishes decides which workloads apply: whole
	// GPUs (wholeGPUs per node), 1g.10gb and 3g.40gb devices, an NVLink
	// domain to match.
	wholeGPUs                  int
	hasMig1g, has3g, hasNVLink bool
	// devicesPerNode and slicesPerNode, from the first node built.
	devicesPerNode, slicesPerNode int
}

func newMix(name, migDefault string) (*mix, error) {
	m := &mix{name: name}
	switch name {
	case MixPlain:
	case MixMigOff:
		spec, err := sim.LookupSpec("dgx-h100-nomig")
		if err != nil {
			return nil, err
		}
		m.machine = &spec
	case MixMigDefault, MixMigAll:
		spec, err := sim.LookupSpec("dgx-h100")
		if err != nil {
			return nil, err
		}
		m.machine = &spec
		policy := slicebuilder.MigPolicyAll
		if name == MixMigDefault {
			policy = migDefault
		}
		if m.policy, err = slicebuilder.ParseMigPolicy(policy); err != nil {
			return nil, err
		}
		if m.policy.Existing {
			// Under "existing" a GPU publishes only the MIG devices made
			// on it (a bare one publishes nothing): nvidia-mig-parted's
			// all-balanced layout on every GPU, as a MIG manager makes it.
			m.layout = "all-balanced"
			for g := range spec.GPUCount {
				spec.MigDevices = append(spec.MigDevices, sim.MigDeviceSpec{GPU: g, Profile: "3g.40gb", Start: 4},
					sim.MigDeviceSpec{GPU: g, Profile: "2g.20gb", Start: 2},
					sim.MigDeviceSpec{GPU: g, Profile: "1g.10gb", Start: 0}, sim.MigDeviceSpec{GPU: g, Profile: "1g.10gb", Start: 1})
			}
			m.machine = &spec
		}
	default:
		return nil, fmt.Errorf("unknown mix %q", name)
	}
	probe, err := m.slices("probe")
	if err != nil {
		return nil, err
	}
	m.slicesPerNode = len(probe)
	for _, s := range probe {
		for _, d := range s.Spec.Devices {
			m.devicesPerNode++
			if a, ok := d.Attributes["type"]; ok && a.StringValue != nil && *a.StringValue == slicebuilder.TypeGPU {
				m.wholeGPUs++
			}
			if a, ok := d.Attributes["migProfile"]; ok && a.StringValue != nil {
				m.hasMig1g = m.hasMig1g || *a.StringValue == "1g.10gb"
				m.has3g = m.has3g || *a.StringValue == "3g.40gb"
			}
			if _, ok := d.Attributes["nvlinkDomain"]; ok {
				m.hasNVLink = true
			}
		}
	}
	return m, nil
}

func (m *mix) policyString() string {
	if m.machine == nil || m.machine.Name != "dgx-h100" {
		return "-"
	}
	if m.layout != "" {
		return m.policy.String() + " (" + m.layout + " made)"
	}
	return m.policy.String()
}

// slices are the ResourceSlices of one node: what the kubelet plugin
// publishes for its simulated machine (each node its own GPUs, UUIDs seeded
// by the node's name), or the plain baseline.
func (m *mix) slices(node string) ([]resourceapi.ResourceSlice, error) {
	if m.machine == nil {
		devs := make([]resourceapi.Device, 0, 8)
		for i := range 8 {
			devs = append(devs, resourceapi.Device{Name: fmt.Sprintf("gpu-%d", i),
				Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{"type": {StringValue: ptr.To(slicebuilder.TypeGPU)}}})
		}
		return []resourceapi.ResourceSlice{{ObjectMeta: metav1.ObjectMeta{Name: node + "-" + slicebuilder.DriverName + "-00"},
			Spec: resourceapi.ResourceSliceSpec{Driver: slicebuilder.DriverName, NodeName: ptr.To(node),
				Pool: resourceapi.ResourcePool{Name: node, Generation: 1, ResourceSliceCount: 1}, Devices: devs}}}, nil
	}
	machine, err := sim.New(*m.machine, node)
	if err != nil {
		return nil, err
	}
	defer machine.Close()
	inv, err := machine.Inventory(context.Background())
	if err != nil {
		return nil, err
	}
	res, err := slicebuilder.Build(inv, node, slicebuilder.Options{Mig: m.policy})
	if err != nil {
		return nil, fmt.Errorf("slices of %s: %w", node, err)
	}
	return slicebuilder.ResourceSlices(res, node), nil
}

// nodeName names the i-th node of every mix.
func nodeName(i int) string { return fmt.Sprintf("n%04d", i) }

// publish adds the nodes first..last-1 (Node objects, Ready, and their
// slices), with pool as each node's pool label. workers creates run in
// parallel on client, the harness's publisher (it stands for every node's
// plugin: one writer, rate-limited by its client).
func publish(ctx context.Context, client kubernetes.Interface, m *mix, first, last int, pool func(i int) string, workers int) error {
	next := make(chan int)
	errCh := make(chan error, workers)
	var wg sync.WaitGroup
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range next {
				if err := addNode(ctx, client, m, nodeName(i), pool(i)); err != nil {
					errCh <- err
					return
				}
			}
		}()
	}
	var err error
feed:
	for i := first; i < last; i++ {
		select {
		case next <- i:
		case err = <-errCh:
			break feed
		case <-ctx.Done():
			err = ctx.Err()
			break feed
		}
	}
	close(next)
	wg.Wait()
	close(errCh)
	for e := range errCh {
		err = errors.Join(err, e)
	}
	return err
}

// addNode creates a Node as devcluster's kubelet registers one (Ready, the
// not-ready taint that admission adds lifted, as no node lifecycle
// controller runs) with room for many pods, and its slices.
func addNode(ctx context.Context, client kubernetes.Interface, m *mix, name, pool string) error {
	slices, err := m.slices(name)
	if err != nil {
		return err
	}
	node := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{
		"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
		"gpu.gpudra.dev/present": "true", poolLabel: pool}}}
	node, err = client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("create Node %s: %w", name, err)
	}
	capacity := v1.ResourceList{v1.ResourceCPU: resource.MustParse("224"), v1.ResourceMemory: resource.MustParse("2Ti"),
		v1.ResourcePods: resource.MustParse("400"), v1.ResourceEphemeralStorage: resource.MustParse("30Ti")}
	now := metav1.Now()
	node.Status = v1.NodeStatus{Capacity: capacity, Allocatable: capacity, Phase: v1.NodeRunning,
		Conditions: []v1.NodeCondition{{Type: v1.NodeReady, Status: v1.ConditionTrue, Reason: "KubeletReady",
			Message: "bench-scale node", LastHeartbeatTime: now, LastTransitionTime: now}},
		Addresses: []v1.NodeAddress{{Type: v1.NodeInternalIP, Address: "127.0.0.1"}, {Type: v1.NodeHostName, Address: name}},
		NodeInfo:  v1.NodeSystemInfo{KubeletVersion: "v1.37.1", OperatingSystem: "linux", Architecture: "amd64", ContainerRuntimeVersion: "devcluster://0"}}
	if node, err = client.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("Node %s status: %w", name, err)
	}
	node.Spec.Taints = nil
	if _, err := client.CoreV1().Nodes().Update(ctx, node, metav1.UpdateOptions{}); err != nil {
		return fmt.Errorf("Node %s taints: %w", name, err)
	}
	for i := range slices {
		if _, err := client.ResourceV1().ResourceSlices().Create(ctx, &slices[i], metav1.CreateOptions{}); err != nil {
			return fmt.Errorf("ResourceSlice %s: %w", slices[i].Name, err)
		}
	}
	return nil
}

var migDevicesDefault = regexp.MustCompile(`--mig-devices string\s.*?\(default "([^"]*)"\)`)

// PluginMigDefault is the default of the kubelet plugin's --mig-devices,
// from the binary's own help: what a node publishes when the chart's
// kubeletPlugin.migDevices is left alone. The environment is cleared, so
// that MIG_DEVICES cannot stand in for the default.
func PluginMigDefault(ctx context.Context, pluginBinary string) (string, error) {
	if pluginBinary == "" {
		return "", errors.New("the kubelet plugin binary is needed for the default MIG device policy (--plugin-binary)")
	}
	cmd := exec.CommandContext(ctx, pluginBinary, "--help")
	cmd.Env = []string{"PATH=" + os.Getenv("PATH")}
	out, _ := cmd.CombinedOutput() // --help may exit non-zero
	if !regexp.MustCompile(`--mig-devices\s`).Match(out) {
		return "", fmt.Errorf("%s --help lists no --mig-devices (an old binary? make build): %s", pluginBinary, firstLine(out))
	}
	if m := migDevicesDefault.FindSubmatch(out); m != nil {
		return string(m[1]), nil
	}
	// pflag prints no default for an empty one: ParseMigPolicy("") is all.
	return "", nil
}

func firstLine(b []byte) string {
	for i, c := range b {
		if c == '\n' {
			return string(b[:i])
		}
	}
	return string(b)
}

// PublishFleet adds nodes API-only nodes of the named mix (MixMigOff: eight
// whole H100s in an NVLink domain each), as the benchmark's points do: Node
// objects, Ready, and the slices their plugins would publish. Used by
// other benchmarks that need a fleet and not its pods (the dashboard's).
func PublishFleet(ctx context.Context, client kubernetes.Interface, mixName string, nodes, workers int) error {
	m, err := newMix(mixName, slicebuilder.MigPolicyAll)
	if err != nil {
		return err
	}
	return publish(ctx, client, m, 0, nodes, func(int) string { return poolGeneral }, workers)
}

// FleetNodeName is the name of the i-th node PublishFleet adds.
func FleetNodeName(i int) string { return nodeName(i) }
