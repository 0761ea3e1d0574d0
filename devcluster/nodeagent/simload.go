package nodeagent

import (
	"errors"
	"fmt"
	"math"
	"strconv"
	"strings"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
)

// SimLoadEnv is the container environment variable through which a pod
// declares the load its container puts on each GPU or MIG device it holds
// (issue 36): `sm=0.4,memory=20Gi`. The node's kubelet lists the
// container's process (the runc container's init, a real host PID) on each
// of the simulated devices its CDI devices give it, with that share of the
// device's SMs and that much framebuffer, so that the simulated NVML
// reports it as it would report a CUDA process: per-process memory and SM
// utilization, the device's utilization, memory, power and temperature.
const SimLoadEnv = "GPUDRA_SIM_LOAD"

// SimLoad is a container's declared load on each of its devices.
type SimLoad struct {
	// SMShare is the share of the device's SMs the process keeps busy
	// (0..1).
	SMShare float64
	// MemoryBytes is the framebuffer the process holds.
	MemoryBytes uint64
}

// simProcesses is what the kubelet needs of a simulated machine to list a
// container's process on its devices: *sim.Machine.
type simProcesses interface {
	// StartProcess lists process pid on the device (GPU or MIG device,
	// by UUID) with the share of its SMs and the framebuffer it uses.
	StartProcess(deviceUUID string, pid int, smShare float64, memoryBytes uint64) error
	// EndProcess takes pid off every device.
	EndProcess(pid int)
}

// The simulated machine takes the loads.
var _ simProcesses = (*sim.Machine)(nil)

// ParseSimLoad parses a SimLoadEnv value: comma-separated key=value items,
// `sm` a share in [0, 1], `memory` a Kubernetes quantity of bytes (20Gi,
// 512Mi, 1e9), each at most once and at least one of them. Anything else
// is an error, never a guess: a typo must not run a pod with no load.
func ParseSimLoad(value string) (SimLoad, error) {
	var load SimLoad
	if value == "" {
		return load, errors.New("empty, want e.g. sm=0.4,memory=20Gi")
	}
	seen := map[string]bool{}
	for _, item := range strings.Split(value, ",") {
		key, val, ok := strings.Cut(item, "=")
		if !ok || val == "" {
			return SimLoad{}, fmt.Errorf("%q: want key=value (sm=<share 0..1>, memory=<quantity>)", item)
		}
		if seen[key] {
			return SimLoad{}, fmt.Errorf("%q given twice", key)
		}
		seen[key] = true
		switch key {
		case "sm":
			share, err := strconv.ParseFloat(val, 64)
			if err != nil || math.IsNaN(share) || share < 0 || share > 1 {
				return SimLoad{}, fmt.Errorf("sm=%s: want a share of the device's SMs from 0 to 1", val)
			}
			load.SMShare = share
		case "memory":
			q, err := resource.ParseQuantity(val)
			if err != nil {
				return SimLoad{}, fmt.Errorf("memory=%s: %w", val, err)
			}
			if q.Sign() < 0 || q.MilliValue()%1000 != 0 {
				return SimLoad{}, fmt.Errorf("memory=%s: want a whole, non-negative number of bytes", val)
			}
			load.MemoryBytes = uint64(q.Value())
		default:
			return SimLoad{}, fmt.Errorf("unknown key %q in %q, want sm and memory", key, item)
		}
	}
	return load, nil
}

// containerSimLoad is the load the container declares (its literal
// SimLoadEnv), nil if none. The error names the pod and the container.
func containerSimLoad(pod *v1.Pod, c *v1.Container) (*SimLoad, error) {
	// The last entry of the name, as the container's environment has it.
	var env *v1.EnvVar
	for i := range c.Env {
		if c.Env[i].Name == SimLoadEnv {
			env = &c.Env[i]
		}
	}
	if e := env; e != nil {
		if e.ValueFrom != nil {
			return nil, fmt.Errorf("pod %s/%s container %s: %s must be a literal value, not valueFrom", pod.Namespace, pod.Name, c.Name, SimLoadEnv)
		}
		load, err := ParseSimLoad(e.Value)
		if err != nil {
			return nil, fmt.Errorf("pod %s/%s container %s: %s=%q: %w", pod.Namespace, pod.Name, c.Name, SimLoadEnv, e.Value, err)
		}
		return &load, nil
	}
	return nil, nil
}

// podSimLoads are the declared loads of the pod's containers, by name;
// the first malformed one is the error, with its container's name.
func podSimLoads(pod *v1.Pod) (map[string]SimLoad, string, error) {
	loads := map[string]SimLoad{}
	for i := range pod.Spec.Containers {
		c := &pod.Spec.Containers[i]
		load, err := containerSimLoad(pod, c)
		if err != nil {
			return nil, c.Name, err
		}
		if load != nil {
			loads[c.Name] = *load
		}
	}
	return loads, "", nil
}
