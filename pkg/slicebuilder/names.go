package slicebuilder

import (
	"fmt"
	"strconv"
	"strings"

	resourceapi "k8s.io/api/resource/v1"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// DriverName is gpudra's DRA driver name.
const DriverName = "gpu.gpudra.dev"

// Capacity names that claims request on fractional GPUs.
const (
	CapacityMemory          resourceapi.QualifiedName = "memory"
	CapacityMultiprocessors resourceapi.QualifiedName = "multiprocessors"
)

// Device types, the value of the "type" attribute.
const (
	TypeGPU = "gpu"
	TypeMIG = "mig"
)

// GPUDeviceName is the stable name of a full GPU: "gpu-<minor>". The minor
// number does not change across restarts and reboots, unlike NVML's index
// order on some systems.
func GPUDeviceName(g *nvdevice.GPU) string { return fmt.Sprintf("gpu-%d", g.Minor) }

// GPUMinor is the GPU minor number a device name carries ("gpu-3",
// "gpu-3-mig-1g-10gb-6": 3), -1 for a name not of that form.
func GPUMinor(name string) int {
	rest, ok := strings.CutPrefix(name, "gpu-")
	if !ok {
		return -1
	}
	digits, _, _ := strings.Cut(rest, "-")
	n, err := strconv.Atoi(digits)
	if err != nil {
		return -1
	}
	return n
}

// MigDeviceName is the stable name of a MIG placement:
// "gpu-<minor>-mig-<profile>-<placement start>", with the profile turned into
// a DNS label ("1g.10gb+me" -> "1g-10gb-me").
func MigDeviceName(g *nvdevice.GPU, profile string, start int) string {
	return fmt.Sprintf("gpu-%d-mig-%s-%d", g.Minor, profileLabel(profile), start)
}

func profileLabel(profile string) string {
	return strings.NewReplacer(".", "-", "+", "-").Replace(strings.ToLower(profile))
}

// CounterSetName names the shared counters of one physical GPU.
func CounterSetName(g *nvdevice.GPU) string { return fmt.Sprintf("gpu-%d-counters", g.Minor) }

// memorySliceCounter names the counter of one MIG memory slice.
func memorySliceCounter(i int) string { return fmt.Sprintf("memory-slice-%d", i) }

// Engine counter names (DNS labels, as counters require).
const (
	counterMemory          = "memory"
	counterMultiprocessors = "multiprocessors"
	counterCopyEngines     = "copy-engines"
	counterDecoders        = "decoders"
	counterJPEGEngines     = "jpeg-engines"
	counterOFAEngines      = "ofa-engines"
)
