package sim

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sort"
	"strings"

	"sigs.k8s.io/yaml"
)

// MachineSpec describes a simulated machine. Built-in machines are specs too,
// and tests and the demo can shape their own nodes in a small YAML file:
//
//	name: two-h100-mig
//	gpuModel: h100-sxm5        # h100-sxm5 | h100-pcie | h200-sxm | l40s
//	gpuCount: 2
//	otherModels:               # other products at some indexes (a mixed node)
//	- {model: l40s, gpus: [1]}
//	nvlink: nvswitch           # nvswitch | bridged-pairs | none
//	migEnabled: all            # all | none | a list of GPU indexes: [0]
//	migDevices:                # MIG devices that exist at start
//	- {gpu: 0, profile: 3g.40gb, start: 4}
//	fabric: {clusterUUID: 4d1c2b3a-0000-4000-8000-000000000001, cliqueID: 7}
type MachineSpec struct {
	Name              string           `json:"name"`
	GPUModel          string           `json:"gpuModel,omitempty"`
	GPUCount          int              `json:"gpuCount"`
	OtherModels       []OtherModelSpec `json:"otherModels,omitempty"`
	NVLink            string           `json:"nvlink,omitempty"`
	MigEnabled        MigEnabledSpec   `json:"migEnabled,omitempty"`
	MigDevices        []MigDeviceSpec  `json:"migDevices,omitempty"`
	Fabric            *FabricSpec      `json:"fabric,omitempty"`
	DriverVersion     string           `json:"driverVersion,omitempty"`
	CUDADriverVersion string           `json:"cudaDriverVersion,omitempty"`
}

// NVLink topologies.
const (
	// NVLinkNVSwitch: every GPU's links go to the board's NVSwitches, all
	// GPUs in one NVLink domain (HGX/DGX H100, HGX H200).
	NVLinkNVSwitch = "nvswitch"
	// NVLinkBridgedPairs: GPUs 0-1, 2-3, ... are joined by NVLink bridges,
	// each pair an NVLink domain of its own (H100 PCIe with NVLink bridges).
	NVLinkBridgedPairs = "bridged-pairs"
	NVLinkNone         = "none"
)

// MigEnabledSpec is "all", "none" or a list of GPU indexes.
type MigEnabledSpec struct {
	All     bool
	Indexes []int
}

// UnmarshalJSON accepts "all", "none" or a list of indexes.
func (m *MigEnabledSpec) UnmarshalJSON(b []byte) error {
	s := strings.TrimSpace(string(b))
	switch s {
	case `"all"`:
		*m = MigEnabledSpec{All: true}
		return nil
	case `"none"`, `null`:
		*m = MigEnabledSpec{}
		return nil
	}
	var idx []int
	if err := yaml.Unmarshal(b, &idx); err != nil {
		return fmt.Errorf(`migEnabled: want "all", "none" or a list of GPU indexes, got %s`, s)
	}
	*m = MigEnabledSpec{Indexes: idx}
	return nil
}

// MarshalJSON is the inverse of UnmarshalJSON. A list is JSON, not
// YAML: sigs.k8s.io/yaml turns a spec into YAML through JSON.
func (m MigEnabledSpec) MarshalJSON() ([]byte, error) {
	if m.All {
		return []byte(`"all"`), nil
	}
	if len(m.Indexes) == 0 {
		return []byte(`"none"`), nil
	}
	return json.Marshal(m.Indexes)
}

func (m MigEnabledSpec) enabled(index int) bool {
	if m.All {
		return true
	}
	for _, i := range m.Indexes {
		if i == index {
			return true
		}
	}
	return false
}

// OtherModelSpec puts another product than gpuModel at some GPU indexes:
// a node that mixes products, such as H100s beside L40S cards, which are
// not MIG-capable.
type OtherModelSpec struct {
	Model string `json:"model"`
	GPUs  []int  `json:"gpus"`
}

// MigDeviceSpec is a MIG device that exists when the machine starts.
type MigDeviceSpec struct {
	GPU     int    `json:"gpu"`
	Profile string `json:"profile"`
	Start   int    `json:"start"`
}

// FabricSpec puts the machine in a multi-node NVLink fabric.
type FabricSpec struct {
	ClusterUUID string `json:"clusterUUID"`
	CliqueID    uint32 `json:"cliqueID"`
}

const (
	defaultDriverVersion     = "570.172.08"
	defaultCUDADriverVersion = "12.8"
	// defaultClusterUUID is the fabric cluster of the built-in multi-node
	// machine; every node built from it is in the same clique.
	defaultClusterUUID = "4d1c2b3a-9e8f-4a7b-8c6d-5e4f3a2b1c0d"
)

// Built-in machines.
var builtins = map[string]MachineSpec{
	// DGX H100: 8 x H100 SXM5 all-to-all through 4 NVSwitches, MIG enabled
	// so that every placement can be offered.
	"dgx-h100": {Name: "dgx-h100", GPUModel: ModelH100SXM5, GPUCount: 8, NVLink: NVLinkNVSwitch,
		MigEnabled: MigEnabledSpec{All: true}},
	// The same board with MIG mode off everywhere.
	"dgx-h100-nomig": {Name: "dgx-h100-nomig", GPUModel: ModelH100SXM5, GPUCount: 8, NVLink: NVLinkNVSwitch},
	// HGX H200: 8 x H200 SXM on the DGX H100's board layout (PCI buses,
	// NUMA nodes, 18 NVLink links each through 4 NVSwitches: one NVLink
	// domain), MIG enabled as dgx-h100.
	"hgx-h200": {Name: "hgx-h200", GPUModel: ModelH200SXM, GPUCount: 8, NVLink: NVLinkNVSwitch,
		MigEnabled: MigEnabledSpec{All: true}},
	// The same board with MIG mode off everywhere, as the real H200 was
	// captured (../shared/real-gpus/h200).
	"hgx-h200-nomig": {Name: "hgx-h200-nomig", GPUModel: ModelH200SXM, GPUCount: 8, NVLink: NVLinkNVSwitch},
	// Two PCIe H100 without NVLink bridges.
	"h100-pcie": {Name: "h100-pcie", GPUModel: ModelH100PCIe, GPUCount: 2, NVLink: NVLinkNone,
		MigEnabled: MigEnabledSpec{All: true}},
	// Four PCIe H100 in two NVLink-bridged pairs (0-1, 2-3): two NVLink
	// domains of two GPUs. MIG is off: MIG instances have no NVLink
	// peer-to-peer, which is what the bridges are for.
	"h100-pcie-nvlink": {Name: "h100-pcie-nvlink", GPUModel: ModelH100PCIe, GPUCount: 4, NVLink: NVLinkBridgedPairs},
	// An H100 node in a multi-node NVLink fabric (NVLink Switch System):
	// a non-zero fabric cluster UUID and clique id. MIG is off: GPUs in MIG
	// mode have no NVLink peer-to-peer, which is what such a node is for.
	"h100-nvlink-fabric": {Name: "h100-nvlink-fabric", GPUModel: ModelH100SXM5, GPUCount: 8, NVLink: NVLinkNVSwitch,
		Fabric: &FabricSpec{ClusterUUID: defaultClusterUUID, CliqueID: 1}},
}

// BuiltinMachines lists the names of the built-in machines.
func BuiltinMachines() []string {
	names := make([]string, 0, len(builtins))
	for n := range builtins {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

// LookupSpec returns a built-in machine by name, or reads a YAML file when
// nameOrFile is not a built-in name.
func LookupSpec(nameOrFile string) (MachineSpec, error) {
	if spec, ok := builtins[nameOrFile]; ok {
		return spec, nil
	}
	data, err := os.ReadFile(nameOrFile)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return MachineSpec{}, fmt.Errorf("machine %q is neither a built-in machine (%s) nor a readable file: %w",
				nameOrFile, strings.Join(BuiltinMachines(), ", "), err)
		}
		return MachineSpec{}, fmt.Errorf("read machine file: %w", err)
	}
	spec, err := ParseSpec(data)
	if err != nil {
		return MachineSpec{}, fmt.Errorf("machine file %s: %w", nameOrFile, err)
	}
	return spec, nil
}

// ParseSpec decodes a YAML machine spec strictly (unknown fields are errors)
// and validates it.
func ParseSpec(data []byte) (MachineSpec, error) {
	var spec MachineSpec
	if err := yaml.UnmarshalStrict(data, &spec); err != nil {
		return MachineSpec{}, err
	}
	if err := spec.Validate(); err != nil {
		return MachineSpec{}, err
	}
	return spec, nil
}

// Validate checks a spec. Defaults (model, driver versions) are applied when
// the machine is built, not here.
func (s MachineSpec) Validate() error {
	var errs []error
	if s.GPUCount < 1 || s.GPUCount > 64 {
		errs = append(errs, fmt.Errorf("gpuCount: must be between 1 and 64, got %d", s.GPUCount))
	}
	model := s.model()
	if _, ok := gpuModels[model]; !ok {
		errs = append(errs, fmt.Errorf("gpuModel: unknown model %q, want one of %s", s.GPUModel, strings.Join(modelNames(), ", ")))
	}
	errs = append(errs, s.validateOtherModels()...)
	switch s.NVLink {
	case "", NVLinkNone:
	case NVLinkNVSwitch:
		if m, ok := gpuModels[model]; ok && m.nvlinkLinks == 0 {
			errs = append(errs, fmt.Errorf("nvlink: model %s has no NVLink to NVSwitches (%s: NVLink bridges between pairs)", model, NVLinkBridgedPairs))
		}
	case NVLinkBridgedPairs:
		if s.GPUCount%2 != 0 {
			errs = append(errs, fmt.Errorf("nvlink: %s needs an even gpuCount, got %d", NVLinkBridgedPairs, s.GPUCount))
		}
		if m, ok := gpuModels[model]; ok && m.bridgeLinks == 0 {
			errs = append(errs, fmt.Errorf("nvlink: model %s has no NVLink bridges (%s needs them)", model, NVLinkBridgedPairs))
		}
	default:
		errs = append(errs, fmt.Errorf("nvlink: unknown topology %q, want %s, %s or %s", s.NVLink, NVLinkNVSwitch, NVLinkBridgedPairs, NVLinkNone))
	}
	for _, i := range s.MigEnabled.Indexes {
		if i < 0 || i >= s.GPUCount {
			errs = append(errs, fmt.Errorf("migEnabled: GPU index %d out of range [0,%d)", i, s.GPUCount))
		} else if m, ok := gpuModels[s.modelOf(i)]; ok && len(m.profiles) == 0 {
			errs = append(errs, fmt.Errorf("migEnabled: GPU %d is a %s, which is not MIG-capable", i, s.modelOf(i)))
		}
	}
	for i, d := range s.MigDevices {
		if d.GPU < 0 || d.GPU >= s.GPUCount {
			errs = append(errs, fmt.Errorf("migDevices[%d].gpu: index %d out of range [0,%d)", i, d.GPU, s.GPUCount))
		} else if !s.migEnabled(d.GPU) {
			errs = append(errs, fmt.Errorf("migDevices[%d].gpu: MIG is not enabled on GPU %d", i, d.GPU))
		}
	}
	if s.Fabric != nil {
		if _, err := parseUUID(s.Fabric.ClusterUUID); err != nil {
			errs = append(errs, fmt.Errorf("fabric.clusterUUID: %w", err))
		}
		if s.NVLink != NVLinkNVSwitch {
			errs = append(errs, fmt.Errorf("fabric: a multi-node NVLink fabric needs nvlink: %s", NVLinkNVSwitch))
		}
	}
	return errors.Join(errs...)
}

// modelNames lists the GPU models a spec can name.
func modelNames() []string {
	names := make([]string, 0, len(gpuModels))
	for n := range gpuModels {
		names = append(names, n)
	}
	sort.Strings(names)
	return names
}

func (s MachineSpec) model() string {
	if s.GPUModel == "" {
		return ModelH100SXM5
	}
	return s.GPUModel
}

// modelOf is the model of the GPU at index i.
func (s MachineSpec) modelOf(i int) string {
	for _, o := range s.OtherModels {
		for _, g := range o.GPUs {
			if g == i {
				return o.Model
			}
		}
	}
	return s.model()
}

// migEnabled says whether GPU i starts in MIG mode: "all" means every
// MIG-capable GPU of the machine.
func (s MachineSpec) migEnabled(i int) bool {
	m, ok := gpuModels[s.modelOf(i)]
	return ok && len(m.profiles) > 0 && s.MigEnabled.enabled(i)
}

// validateOtherModels checks otherModels: known models, indexes in range
// and named once, and an NVLink topology every GPU of the pair or board
// can be part of.
func (s MachineSpec) validateOtherModels() []error {
	var errs []error
	seen := map[int]bool{}
	for i, o := range s.OtherModels {
		m, ok := gpuModels[o.Model]
		if !ok {
			errs = append(errs, fmt.Errorf("otherModels[%d].model: unknown model %q, want one of %s", i, o.Model, strings.Join(modelNames(), ", ")))
		}
		if len(o.GPUs) == 0 {
			errs = append(errs, fmt.Errorf("otherModels[%d].gpus: name at least one GPU index", i))
		}
		for _, g := range o.GPUs {
			switch {
			case g < 0 || g >= s.GPUCount:
				errs = append(errs, fmt.Errorf("otherModels[%d].gpus: GPU index %d out of range [0,%d)", i, g, s.GPUCount))
			case seen[g]:
				errs = append(errs, fmt.Errorf("otherModels[%d].gpus: GPU %d is named twice", i, g))
			}
			seen[g] = true
		}
		if ok && s.NVLink == NVLinkBridgedPairs && m.bridgeLinks == 0 {
			errs = append(errs, fmt.Errorf("otherModels[%d].model: %s has no NVLink bridges (nvlink: %s needs them on every GPU)", i, o.Model, NVLinkBridgedPairs))
		}
	}
	return errs
}
