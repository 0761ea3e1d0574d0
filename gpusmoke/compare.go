package gpusmoke

import (
	"context"
	"fmt"
	"io"
	"sort"
	"strings"
	"text/tabwriter"

	resourceapi "k8s.io/api/resource/v1"

	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// SimMachineFor is the simulated machine that models a GPU of this
// product (its NVML product name), "" when the simulator has none. Near
// names of other products are not taken for a modelled one: "NVIDIA H100
// NVL" (94 GB) is no H100 80GB, "NVIDIA H200 NVL" and "NVIDIA GH200
// 480GB" (a Grace Hopper superchip) are no H200 SXM.
func SimMachineFor(product string) string {
	switch {
	case product == "NVIDIA H200":
		return "hgx-h200-nomig"
	case strings.Contains(product, "NVL"):
		return ""
	case strings.Contains(product, "H100") && strings.Contains(product, "PCIe"):
		return "h100-pcie"
	case strings.Contains(product, "H100"):
		return "dgx-h100-nomig"
	}
	return ""
}

// Marks in a comparison row.
const (
	// MarkDefect: the model publishes something else than the real GPU, a
	// defect of the simulator (or of ../shared/facts/h100.md) to fix.
	MarkDefect = "*"
	// MarkExpected: the row differs, as it must between a model and a host
	// (see expectedToDiffer).
	MarkExpected = "~"
)

// expectedToDiffer are the rows that differ between any model and any
// host: what identifies one GPU (UUID, serial, the NVLink domain named
// after a UUID), where the GPU sits in its host (PCI bus, PCIe root, NUMA
// node: the model is a DGX board, the host may be a VM), and the driver and
// CUDA versions the host runs (the model has fixed ones).
var expectedToDiffer = map[string]bool{
	"attribute uuid":                            true,
	"attribute serial":                          true,
	"attribute nvlinkDomain":                    true,
	"attribute resource.kubernetes.io/pciBusID": true,
	"attribute resource.kubernetes.io/pcieRoot": true,
	"attribute resource.kubernetes.io/numaNode": true,
	"attribute driverVersion":                   true,
	"attribute cudaDriverVersion":               true,
}

// Compare prints the whole-GPU device the plugin publishes for the lowest
// GPU of the NVML inventory beside the one it publishes for the
// simulator's model of the same product, attribute by attribute and
// capacity by capacity, marking each difference.
func Compare(ctx context.Context, w io.Writer, inv *nvdevice.Inventory) error {
	real := inv.GPUs[0]
	for _, g := range inv.GPUs {
		if g.Index < real.Index {
			real = g
		}
	}
	fmt.Fprintf(w, "== gpudra inventory --backend nvml: %d GPU(s), driver %s, CUDA %s; GPU %d: %s %s\n",
		len(inv.GPUs), inv.DriverVersion, inv.CUDADriverVersion, real.Index, real.ProductName, real.UUID)
	name := SimMachineFor(real.ProductName)
	if name == "" {
		fmt.Fprintf(w, "the simulator has no model of %q: nothing to compare\n", real.ProductName)
		return nil
	}
	spec, err := sim.LookupSpec(name)
	if err != nil {
		return err
	}
	// The whole GPU is compared, which a GPU in MIG mode does not publish:
	// the model with MIG mode off (h100-pcie has it on).
	spec.MigEnabled, spec.MigDevices = sim.MigEnabledSpec{}, nil
	m, err := sim.New(spec, GPUNode)
	if err != nil {
		return err
	}
	simInv, err := m.Inventory(ctx)
	if err != nil {
		return err
	}
	modelled := simInv.GPUs[0]
	a, err := publishedDevice(&nvdevice.Inventory{DriverVersion: inv.DriverVersion, CUDADriverVersion: inv.CUDADriverVersion, GPUs: []nvdevice.GPU{real}})
	if err != nil {
		return fmt.Errorf("NVML GPU %d: %w", real.Index, err)
	}
	b, err := publishedDevice(&nvdevice.Inventory{DriverVersion: simInv.DriverVersion, CUDADriverVersion: simInv.CUDADriverVersion, GPUs: []nvdevice.GPU{modelled}})
	if err != nil {
		return fmt.Errorf("simulated %s: %w", name, err)
	}
	rows, defects, expected := CompareDevices(a, b)
	fmt.Fprintf(w, "published device %s (NVML) beside the simulator's %s GPU 0 (%s); %s marks a defect of the model, %s a difference expected between a model and a host\n",
		a.Name, name, modelled.ProductName, MarkDefect, MarkExpected)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "\tNAME\tNVML\tSIMULATOR")
	for _, r := range rows {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", r.Mark, r.Name, r.Real, r.Simulated)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	fmt.Fprintf(w, "%d defect(s) (%s), %d expected difference(s) (%s: identity, place in the host, driver and CUDA versions) in %d attributes and capacities\n",
		defects, MarkDefect, expected, MarkExpected, len(rows))
	return nil
}

// Row is one attribute or capacity of both devices.
type Row struct {
	Mark, Name, Real, Simulated string
}

// CompareDevices lines up two devices' attributes and capacities by name;
// "-" is a missing one. It returns the rows, how many differ where they
// should not (MarkDefect) and how many differ as they must
// (MarkExpected).
func CompareDevices(real, simulated resourceapi.Device) (rows []Row, defects, expected int) {
	values := func(d resourceapi.Device) map[string]string {
		out := map[string]string{}
		for k, v := range d.Attributes {
			out["attribute "+string(k)] = attributeString(v)
		}
		for k, v := range d.Capacity {
			out["capacity "+string(k)] = v.Value.String()
		}
		return out
	}
	a, b := values(real), values(simulated)
	names := map[string]bool{}
	for k := range a {
		names[k] = true
	}
	for k := range b {
		names[k] = true
	}
	for k := range names {
		r := Row{Name: k, Real: orDash(a[k]), Simulated: orDash(b[k])}
		switch {
		case r.Real == r.Simulated:
		case expectedToDiffer[k]:
			r.Mark = MarkExpected
			expected++
		default:
			r.Mark = MarkDefect
			defects++
		}
		rows = append(rows, r)
	}
	sort.Slice(rows, func(i, j int) bool { return rows[i].Name < rows[j].Name })
	return rows, defects, expected
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func attributeString(v resourceapi.DeviceAttribute) string {
	switch {
	case v.StringValue != nil:
		return *v.StringValue
	case v.IntValue != nil:
		return fmt.Sprint(*v.IntValue)
	case v.BoolValue != nil:
		return fmt.Sprint(*v.BoolValue)
	case v.VersionValue != nil:
		return *v.VersionValue
	}
	return ""
}

// publishedDevice is the whole-GPU device the plugin publishes for the
// inventory's one GPU.
func publishedDevice(inv *nvdevice.Inventory) (resourceapi.Device, error) {
	res, err := slicebuilder.Build(inv, GPUNode, slicebuilder.Options{Mig: slicebuilder.MigPolicy{Existing: true}})
	if err != nil {
		return resourceapi.Device{}, err
	}
	want := slicebuilder.GPUDeviceName(&inv.GPUs[0])
	for _, pool := range res.Pools {
		for _, s := range pool.Slices {
			for _, d := range s.Devices {
				if d.Name == want {
					return d, nil
				}
			}
		}
	}
	return resourceapi.Device{}, fmt.Errorf("no device %s published (a GPU in MIG mode publishes none whole)", want)
}
