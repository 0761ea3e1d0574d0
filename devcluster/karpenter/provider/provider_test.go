package provider

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourcev1 "k8s.io/api/resource/v1"
	dracel "k8s.io/dynamic-resource-allocation/cel"
	"sigs.k8s.io/karpenter/pkg/cloudprovider"
	"sigs.k8s.io/karpenter/pkg/scheduling/dynamicresources"
	"sigs.k8s.io/yaml"
)

// gpudraSlices runs `gpudra slices ... -o karpenter` from the repository
// (CGO_ENABLED=0, the main module's own toolchain) and gives its output.
func gpudraSlices(t *testing.T, args ...string) []byte {
	t.Helper()
	root, err := filepath.Abs(filepath.Join("..", "..", ".."))
	require.NoError(t, err)
	cmd := exec.Command("go", append([]string{"run", "./cmd/gpudra", "slices", "-o", "karpenter"}, args...)...)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOTOOLCHAIN=local")
	out, err := cmd.Output()
	var stderr []byte
	if ee, ok := err.(*exec.ExitError); ok {
		stderr = ee.Stderr
	}
	require.NoError(t, err, "%s", stderr)
	return out
}

// TestGpudraTemplatesAreKarpentersTypes: what `gpudra slices --machine
// p5.48xlarge -o karpenter` prints decodes, field for field (unknown fields
// refused), into Karpenter's ResourceSliceTemplates, and Karpenter's own
// CEL evaluation (DeviceMatchesSelectors, as its provisioner runs it)
// selects on them what the scheduler selects on the node's slices: the
// DeviceClass's GPUs, and a memory selector only an H200 satisfies.
func TestGpudraTemplatesAreKarpentersTypes(t *testing.T) {
	bigMemory := resourcev1.DeviceSelector{CEL: &resourcev1.CELDeviceSelector{Expression: `device.capacity["gpu.gpudra.dev"].memory.compareTo(quantity("100Gi")) >= 0`}}
	gpuClass := resourcev1.DeviceSelector{CEL: &resourcev1.CELDeviceSelector{Expression: `device.driver == "gpu.gpudra.dev" && device.attributes["gpu.gpudra.dev"].type == "gpu"`}}
	cache := dracel.NewCache(0, dracel.Features{EnableConsumableCapacity: true})
	for _, tt := range []struct {
		machine         string
		gpus            int
		bigMemoryGPUs   int
		counters, other int
		extra           []string
	}{
		{machine: "p5.48xlarge", gpus: 8, bigMemoryGPUs: 0},
		{machine: "p5e.48xlarge", gpus: 8, bigMemoryGPUs: 8},
		// In MIG mode under "all", each GPU is published whole too, its
		// MIG placements beside it, all on the GPU's counters.
		{machine: "p5.48xlarge", extra: []string{"--mig-mode", "--mig-devices", "all"}, gpus: 8, counters: 8, other: 8 * 25},
	} {
		raw, err := yaml.YAMLToJSON(gpudraSlices(t, append([]string{"--machine", tt.machine}, tt.extra...)...))
		require.NoError(t, err)
		templates, err := DecodeTemplates(raw)
		require.NoError(t, err, "%s %v", tt.machine, tt.extra)
		for _, tmpl := range templates {
			// Karpenter caches a selector's match by driver, pool and
			// device, across types: each type's pool must be its own.
			assert.Equal(t, tt.machine, tmpl.Pool.Name.Value(), "the pool is named after the type")
		}
		gpus, big, counters, other := 0, 0, 0, 0
		for _, tmpl := range templates {
			assert.Equal(t, "gpu.gpudra.dev", tmpl.Driver.Value())
			counters += len(tmpl.SharedCounters)
			for _, d := range tmpl.Devices {
				id := dynamicresources.DeviceID{DeviceID: cloudprovider.DeviceID{Driver: tmpl.Driver, Pool: tmpl.Pool.Name, Device: d.Name}, Template: true}
				isGPU, err := dynamicresources.DeviceMatchesSelectors(context.Background(), d, id, []resourcev1.DeviceSelector{gpuClass}, cache)
				require.NoError(t, err)
				if !isGPU {
					other++
					continue
				}
				gpus++
				ok, err := dynamicresources.DeviceMatchesSelectors(context.Background(), d, id, []resourcev1.DeviceSelector{bigMemory}, cache)
				require.NoError(t, err)
				if ok {
					big++
				}
			}
		}
		assert.Equal(t, tt.gpus, gpus, "%s %v: the DeviceClass's GPUs", tt.machine, tt.extra)
		assert.Equal(t, tt.bigMemoryGPUs, big, "%s %v: GPUs of more than 100Gi", tt.machine, tt.extra)
		assert.Equal(t, tt.counters, counters, "%s %v: counter sets", tt.machine, tt.extra)
		assert.Equal(t, tt.other, other, "%s %v: other devices", tt.machine, tt.extra)
	}
}

// TestDecodeTemplatesRefuses: a field Karpenter's types lack, and devices
// with counters in one template, are refused naming where.
func TestDecodeTemplatesRefuses(t *testing.T) {
	_, err := DecodeTemplates([]byte(`{"instanceType":"x","resourceSliceTemplates":[{"driver":"d","pool":"p","devices":[{"name":"a","bogus":1}]}]}`))
	require.ErrorContains(t, err, `unknown field "bogus"`)
	_, err = DecodeTemplates([]byte(`{"instanceType":"x","resourceSliceTemplates":[{"driver":"d","pool":"p","devices":[{"name":"a"}],"sharedCounters":[{"name":"c"}]}]}`))
	require.ErrorContains(t, err, "resourceSliceTemplates[0]: devices and sharedCounters in one template")
}
