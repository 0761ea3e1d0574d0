package provider

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"
	"unique"

	corev1 "k8s.io/api/core/v1"
	resourcev1 "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	karpv1 "sigs.k8s.io/karpenter/pkg/apis/v1"
	"sigs.k8s.io/karpenter/pkg/cloudprovider"
	"sigs.k8s.io/karpenter/pkg/scheduling"

	"github.com/gpudra/gpudra/devcluster/cloudapi"
)

// Labels a machine of the cloud carries besides the well-known ones, for
// NodePools to select on.
const (
	LabelGPUProduct = Group + "/gpu-product"
	LabelGPUCount   = Group + "/gpu-count"
)

// Templates is what `gpudra slices -o karpenter` prints (and the cloud
// serves with each type): gpudra's machinetype.Templates, decoded into the
// Kubernetes types Karpenter is built with.
type Templates struct {
	InstanceType           string             `json:"instanceType"`
	MIGMode                bool               `json:"migMode"`
	MIGDevices             string             `json:"migDevices"`
	ResourceSliceTemplates []ResourceTemplate `json:"resourceSliceTemplates"`
}

// ResourceTemplate is one template of Templates.
type ResourceTemplate struct {
	Driver         string                  `json:"driver"`
	Pool           string                  `json:"pool"`
	Devices        []resourcev1.Device     `json:"devices,omitempty"`
	SharedCounters []resourcev1.CounterSet `json:"sharedCounters,omitempty"`
}

// DecodeTemplates reads templates as `gpudra slices -o karpenter -o json`
// or the cloud writes them, refusing a field Karpenter's types do not have,
// and gives Karpenter's ResourceSliceTemplates: devices and counter sets
// in separate templates, as Karpenter requires.
func DecodeTemplates(raw []byte) ([]*cloudprovider.ResourceSliceTemplate, error) {
	var doc Templates
	if err := strictJSON(raw, &doc); err != nil {
		return nil, fmt.Errorf("resource slice templates: %w", err)
	}
	out := make([]*cloudprovider.ResourceSliceTemplate, 0, len(doc.ResourceSliceTemplates))
	for i, t := range doc.ResourceSliceTemplates {
		if t.Driver == "" || t.Pool == "" {
			return nil, fmt.Errorf("resource slice templates of %s: resourceSliceTemplates[%d]: driver and pool must be set", doc.InstanceType, i)
		}
		if len(t.Devices) > 0 && len(t.SharedCounters) > 0 {
			return nil, fmt.Errorf("resource slice templates of %s: resourceSliceTemplates[%d]: devices and sharedCounters in one template (Karpenter ignores the devices)", doc.InstanceType, i)
		}
		tmpl := &cloudprovider.ResourceSliceTemplate{Driver: unique.Make(t.Driver),
			Pool: cloudprovider.ResourcePool{Name: unique.Make(t.Pool)}, SharedCounters: t.SharedCounters}
		for _, d := range t.Devices {
			tmpl.Devices = append(tmpl.Devices, cloudprovider.Device{Name: unique.Make(d.Name), Attributes: d.Attributes,
				Capacity: d.Capacity, AllowMultipleAllocations: d.AllowMultipleAllocations != nil && *d.AllowMultipleAllocations,
				ConsumesCounters: d.ConsumesCounters})
		}
		out = append(out, tmpl)
	}
	return out, nil
}

func strictJSON(raw []byte, v any) error {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	return dec.Decode(v)
}

// OnDemand is the one capacity type the cloud sells.
const OnDemand = karpv1.CapacityTypeOnDemand

// InstanceTypeOf is a type of the cloud as Karpenter sees it: requirements
// on the well-known labels (and the GPU's), one on-demand offering in the
// cloud's one zone, the node's capacity, and its ResourceSlice templates.
func InstanceTypeOf(t cloudapi.InstanceType) (*cloudprovider.InstanceType, error) {
	templates, err := DecodeTemplates(t.Templates)
	if err != nil {
		return nil, fmt.Errorf("instance type %s: %w", t.Name, err)
	}
	capacity := corev1.ResourceList{}
	for name, q := range map[corev1.ResourceName]string{corev1.ResourceCPU: t.CPU, corev1.ResourceMemory: t.Memory,
		corev1.ResourcePods: t.Pods, corev1.ResourceEphemeralStorage: t.EphemeralStorage} {
		v, err := resource.ParseQuantity(q)
		if err != nil {
			return nil, fmt.Errorf("instance type %s: %s: %w", t.Name, name, err)
		}
		capacity[name] = v
	}
	return &cloudprovider.InstanceType{
		Name: t.Name,
		Requirements: scheduling.NewRequirements(
			scheduling.NewRequirement(corev1.LabelInstanceTypeStable, corev1.NodeSelectorOpIn, t.Name),
			scheduling.NewRequirement(corev1.LabelArchStable, corev1.NodeSelectorOpIn, karpv1.ArchitectureAmd64),
			scheduling.NewRequirement(corev1.LabelOSStable, corev1.NodeSelectorOpIn, string(corev1.Linux)),
			scheduling.NewRequirement(corev1.LabelTopologyZone, corev1.NodeSelectorOpIn, cloudapi.Zone),
			scheduling.NewRequirement(karpv1.CapacityTypeLabelKey, corev1.NodeSelectorOpIn, OnDemand),
			scheduling.NewRequirement(LabelGPUProduct, corev1.NodeSelectorOpIn, labelValue(t.GPUProduct)),
			scheduling.NewRequirement(LabelGPUCount, corev1.NodeSelectorOpIn, strconv.Itoa(t.GPUs)),
		),
		Offerings: cloudprovider.Offerings{{
			Requirements: scheduling.NewRequirements(
				scheduling.NewRequirement(corev1.LabelTopologyZone, corev1.NodeSelectorOpIn, cloudapi.Zone),
				scheduling.NewRequirement(karpv1.CapacityTypeLabelKey, corev1.NodeSelectorOpIn, OnDemand)),
			Price: t.PricePerHour, Available: true,
		}},
		Capacity:         capacity,
		Overhead:         &cloudprovider.InstanceTypeOverhead{KubeReserved: corev1.ResourceList{corev1.ResourceCPU: resource.MustParse("100m"), corev1.ResourceMemory: resource.MustParse("100Mi")}},
		DynamicResources: cloudprovider.DynamicResources{ResourceSliceTemplates: templates},
	}, nil
}

// labelValue is the GPU product as a label value: NVML's name with its
// spaces as dashes ("NVIDIA-H100-80GB-HBM3", as NVIDIA's GPU feature
// discovery labels nvidia.com/gpu.product).
func labelValue(product string) string {
	out := []byte(product)
	for i, c := range out {
		if c == ' ' {
			out[i] = '-'
		}
	}
	return string(out)
}
