// Package machinetype says, for a machine type, what a fresh node of that
// type publishes: the ResourceSlices gpudra's kubelet plugin will write once
// the node runs, before the node exists. An autoscaler simulates a node it
// has not made yet from them (Karpenter's
// InstanceType.DynamicResources.ResourceSliceTemplates).
//
// It is a pure function of the type and of the plugin's publishing options:
// the simulator's machine of the type (pkg/nvdevice/sim, faithful to the
// real GPUs) read as the plugin reads its node, built into slices by the
// plugin's own slicebuilder. A test runs the real plugin on a fresh
// simulated node of each type and compares.
package machinetype

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	resourceapi "k8s.io/api/resource/v1"

	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// Type is a machine type whose GPUs gpudra knows.
type Type struct {
	// Name is the cloud's name for the type, or a simulated machine's.
	Name string `json:"name"`
	// Provider is the cloud that sells it ("" for the simulator's).
	Provider string `json:"provider,omitempty"`
	// GPUs and GPUProduct: how many GPUs, and what NVML calls them.
	GPUs       int    `json:"gpus"`
	GPUProduct string `json:"gpuProduct"`
	// machines are the simulator's machines of the type: MIG mode off on
	// every GPU (as the clouds deliver them), and on.
	machine, migMachine string
}

// The cloud types of 8 H100 SXM or 8 H200 SXM, one NVLink domain of four
// NVSwitches each (the boards of a DGX/HGX H100 and H200).
var cloudTypes = []Type{
	{Name: "p5.48xlarge", Provider: "aws", machine: "dgx-h100-nomig", migMachine: "dgx-h100"},
	{Name: "a3-highgpu-8g", Provider: "gcp", machine: "dgx-h100-nomig", migMachine: "dgx-h100"},
	{Name: "Standard_ND96isr_H100_v5", Provider: "azure", machine: "dgx-h100-nomig", migMachine: "dgx-h100"},
	{Name: "p5e.48xlarge", Provider: "aws", machine: "hgx-h200-nomig", migMachine: "hgx-h200"},
	{Name: "p5en.48xlarge", Provider: "aws", machine: "hgx-h200-nomig", migMachine: "hgx-h200"},
	{Name: "a3-ultragpu-8g", Provider: "gcp", machine: "hgx-h200-nomig", migMachine: "hgx-h200"},
}

// Types are the cloud types, then the simulator's built-in machines (each
// in the MIG mode it is built with).
func Types() []Type {
	out := make([]Type, 0, len(cloudTypes))
	for _, t := range cloudTypes {
		out = append(out, describe(t))
	}
	for _, name := range sim.BuiltinMachines() {
		out = append(out, describe(Type{Name: name, machine: name}))
	}
	return out
}

// describe fills in the GPU count and product from the simulator's machine.
func describe(t Type) Type {
	if spec, err := sim.LookupSpec(t.machine); err == nil {
		if m, err := sim.New(spec, "describe"); err == nil {
			if inv, err := m.Inventory(context.Background()); err == nil && len(inv.GPUs) > 0 {
				t.GPUs, t.GPUProduct = len(inv.GPUs), inv.GPUs[0].ProductName
			}
		}
	}
	return t
}

// Lookup finds a type by its name.
func Lookup(name string) (Type, error) {
	for _, t := range Types() {
		if t.Name == name {
			return t, nil
		}
	}
	names := make([]string, 0, len(cloudTypes))
	for _, t := range Types() {
		names = append(names, t.Name)
	}
	return Type{}, fmt.Errorf("unknown machine type %q: known are %s", name, strings.Join(names, ", "))
}

// Machine is the simulator's machine of the type, with MIG mode on every
// GPU or none. A simulated machine has the MIG mode it is built with.
func (t Type) Machine(migMode bool) (string, error) {
	if !migMode {
		return t.machine, nil
	}
	if t.migMachine == "" {
		if spec, err := sim.LookupSpec(t.machine); err == nil && spec.MigEnabled.All {
			return t.machine, nil
		}
		return "", fmt.Errorf("machine type %s: no MIG mode variant (its GPUs' MIG mode is the machine's own)", t.Name)
	}
	return t.migMachine, nil
}

// ErrNotFresh says that options describe what a fresh node cannot have: MIG
// devices the plugin made, or taints.
var ErrNotFresh = errors.New("a fresh node has no MIG devices the plugin made and no taints")

// Slices are the ResourceSlices a fresh node named node of type t publishes,
// in MIG mode or not, under the plugin's publishing options (its flags and
// the node's gpu.gpudra.dev/mig-devices annotation, as the plugin resolves
// them). A fresh node has no MIG device yet: under the MIG policy
// "existing" a GPU in MIG mode publishes nothing (neither MIG devices nor
// the whole GPU) until an administrator creates instances, exactly as the
// plugin does on such a node; "all" and "profiles=" publish the placements
// the plugin would create at prepare.
func Slices(ctx context.Context, t Type, migMode bool, node string, opts slicebuilder.Options) ([]resourceapi.ResourceSlice, error) {
	if len(opts.ManagedMigDevices) > 0 || len(opts.Taints) > 0 {
		return nil, ErrNotFresh
	}
	name, err := t.Machine(migMode)
	if err != nil {
		return nil, err
	}
	m, err := sim.NewBuiltin(name, node)
	if err != nil {
		return nil, fmt.Errorf("machine type %s: %w", t.Name, err)
	}
	defer m.Close()
	inv, err := m.Inventory(ctx)
	if err != nil {
		return nil, fmt.Errorf("machine type %s: %w", t.Name, err)
	}
	res, err := slicebuilder.Build(inv, node, opts)
	if err != nil {
		return nil, fmt.Errorf("machine type %s: %w", t.Name, err)
	}
	return slicebuilder.ResourceSlices(res, node), nil
}

// NodeSpecificAttributes are the attributes whose values a node learns
// only from its own GPUs: an autoscaler's template cannot know them.
var NodeSpecificAttributes = []resourceapi.QualifiedName{"uuid", "parentUUID"}

// Template is one ResourceSlice a node of the type will publish, as an
// autoscaler simulates it (Karpenter's ResourceSliceTemplate: node-local,
// no node name; devices and shared counters in separate templates, as in
// separate slices).
type Template struct {
	Driver         string                   `json:"driver"`
	Pool           string                   `json:"pool"`
	Devices        []resourceapi.Device     `json:"devices,omitempty"`
	SharedCounters []resourceapi.CounterSet `json:"sharedCounters,omitempty"`
}

// Templates is what `gpudra slices -o karpenter` prints: a type's
// templates under one publishing policy.
type Templates struct {
	InstanceType string `json:"instanceType"`
	MIGMode      bool   `json:"migMode"`
	// MIGDevices is the policy the templates were made under (the
	// plugin's --mig-devices, or the node's annotation).
	MIGDevices             string     `json:"migDevices"`
	ResourceSliceTemplates []Template `json:"resourceSliceTemplates"`
}

// TemplatesOf are the slices of Slices as an autoscaler's templates: no
// node name, and none of NodeSpecificAttributes. The pool is named after
// the type, as if a node were: one type's devices are never another's.
// Karpenter v1.15 caches a device's selector match by driver, pool and
// device name, not by type: with one pool name for every type, the first
// type's answer ("gpu-0 has 80 GB") was every type's, and a claim for an
// H200's memory never fit the H200 type (docs/autoscaling.md). migDevices is the policy
// as the plugin's flag spells it.
func TemplatesOf(ctx context.Context, t Type, migMode bool, migDevices string, opts slicebuilder.Options) (Templates, error) {
	objs, err := Slices(ctx, t, migMode, t.Name, opts)
	if err != nil {
		return Templates{}, err
	}
	out := Templates{InstanceType: t.Name, MIGMode: migMode, MIGDevices: migDevices, ResourceSliceTemplates: []Template{}}
	for _, o := range objs {
		spec := o.Spec.DeepCopy()
		for i := range spec.Devices {
			for _, a := range NodeSpecificAttributes {
				delete(spec.Devices[i].Attributes, a)
			}
		}
		out.ResourceSliceTemplates = append(out.ResourceSliceTemplates,
			Template{Driver: spec.Driver, Pool: spec.Pool.Name, Devices: spec.Devices, SharedCounters: spec.SharedCounters})
	}
	return out, nil
}

// Names are the names of the known types, sorted.
func Names() []string {
	var out []string
	for _, t := range Types() {
		out = append(out, t.Name)
	}
	slices.Sort(out)
	return out
}
