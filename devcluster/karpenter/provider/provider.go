// Package provider is Karpenter's cloud provider for devcluster: it buys
// and terminates machines of devcluster's cloud (devcluster/cloud) for
// NodeClaims, and gives Karpenter the cloud's instance types with the
// ResourceSlices a fresh node of each type publishes (gpudra's
// machinetype templates), so that Karpenter's DRA simulation can tell
// which type a pending pod's ResourceClaims fit.
//
// It is compiled into Karpenter's binary (cmd/devcluster-karpenter), on
// Karpenter's own Kubernetes libraries, as a cloud's provider is.
package provider

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"strings"
	"sync"

	"github.com/awslabs/operatorpkg/status"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/controller-runtime/pkg/client"
	karpv1 "sigs.k8s.io/karpenter/pkg/apis/v1"
	"sigs.k8s.io/karpenter/pkg/cloudprovider"
	"sigs.k8s.io/karpenter/pkg/scheduling"

	"github.com/gpudra/gpudra/devcluster/cloudapi"
)

// CloudProvider is Karpenter's cloudprovider.CloudProvider over
// devcluster's cloud.
type CloudProvider struct {
	kube  client.Client
	cloud *CloudClient

	mu sync.Mutex
	// types caches the cloud's instance types per configuration: a type's
	// templates are a pure function of it (machinetype).
	types map[cloudapi.Configuration][]*cloudprovider.InstanceType
}

var _ cloudprovider.CloudProvider = (*CloudProvider)(nil)

// New is a provider that reads NodeClasses with kube and buys from cloud.
func New(kube client.Client, cloud *CloudClient) *CloudProvider {
	return &CloudProvider{kube: kube, cloud: cloud, types: map[cloudapi.Configuration][]*cloudprovider.InstanceType{}}
}

// Name is the provider's name.
func (p *CloudProvider) Name() string { return "devcluster" }

// GetSupportedNodeClasses is GPUNodeClass.
func (p *CloudProvider) GetSupportedNodeClasses() []status.Object {
	return []status.Object{&GPUNodeClass{}}
}

// nodeClass is the GPUNodeClass a NodePool or NodeClaim names.
func (p *CloudProvider) nodeClass(ctx context.Context, ref *karpv1.NodeClassReference) (*GPUNodeClass, error) {
	if ref == nil {
		return nil, errors.New("no nodeClassRef")
	}
	if ref.Group != Group || ref.Kind != "GPUNodeClass" {
		return nil, fmt.Errorf("nodeClassRef %s/%s %s: devcluster's provider serves %s GPUNodeClass only", ref.Group, ref.Kind, ref.Name, Group)
	}
	nc := &GPUNodeClass{}
	if err := p.kube.Get(ctx, types.NamespacedName{Name: ref.Name}, nc); err != nil {
		return nil, fmt.Errorf("GPUNodeClass %s: %w", ref.Name, err)
	}
	return nc, nil
}

// GetInstanceTypes are the cloud's types under the NodePool's
// NodeClass's configuration.
func (p *CloudProvider) GetInstanceTypes(ctx context.Context, nodePool *karpv1.NodePool) ([]*cloudprovider.InstanceType, error) {
	nc, err := p.nodeClass(ctx, nodePool.Spec.Template.Spec.NodeClassRef)
	if err != nil {
		return nil, fmt.Errorf("NodePool %s: %w", nodePool.Name, err)
	}
	return p.instanceTypes(ctx, nc.Spec)
}

func (p *CloudProvider) instanceTypes(ctx context.Context, cfg cloudapi.Configuration) ([]*cloudprovider.InstanceType, error) {
	p.mu.Lock()
	cached, ok := p.types[cfg]
	p.mu.Unlock()
	if ok {
		return cached, nil
	}
	raw, err := p.cloud.InstanceTypes(ctx, cfg)
	if err != nil {
		return nil, err
	}
	out := make([]*cloudprovider.InstanceType, 0, len(raw))
	for _, t := range raw {
		it, err := InstanceTypeOf(t)
		if err != nil {
			return nil, err
		}
		out = append(out, it)
	}
	p.mu.Lock()
	p.types[cfg] = out
	p.mu.Unlock()
	return out, nil
}

// Create buys the cheapest machine of the NodeClaim's types that its
// requirements allow, its node to register with the NodeClaim's labels and
// taints, and Karpenter's unregistered taint.
func (p *CloudProvider) Create(ctx context.Context, nodeClaim *karpv1.NodeClaim) (*karpv1.NodeClaim, error) {
	nc, err := p.nodeClass(ctx, nodeClaim.Spec.NodeClassRef)
	if err != nil {
		return nil, cloudprovider.NewInsufficientCapacityError(fmt.Errorf("NodeClaim %s: %w", nodeClaim.Name, err))
	}
	if cond := nc.StatusConditions().Get(status.ConditionReady); cond.IsFalse() {
		return nil, cloudprovider.NewNodeClassNotReadyError(errors.New(cond.Message))
	}
	types, err := p.instanceTypes(ctx, nc.Spec)
	if err != nil {
		return nil, err
	}
	reqs := scheduling.NewNodeSelectorRequirementsWithMinValues(nodeClaim.Spec.Requirements...)
	it, offering := cheapest(types, reqs)
	if it == nil {
		return nil, cloudprovider.NewInsufficientCapacityError(fmt.Errorf("NodeClaim %s: no instance type of the cloud meets its requirements", nodeClaim.Name))
	}
	labels := nodeLabels(nodeClaim, it, offering)
	taints := []cloudapi.Taint{}
	for _, t := range append(append(append([]corev1.Taint{}, nodeClaim.Spec.Taints...), nodeClaim.Spec.StartupTaints...), karpv1.UnregisteredNoExecuteTaint) {
		taints = append(taints, cloudapi.Taint{Key: t.Key, Value: t.Value, Effect: string(t.Effect)})
	}
	m, err := p.cloud.Create(ctx, cloudapi.MachineRequest{Name: nodeClaim.Name, InstanceType: it.Name, Configuration: nc.Spec, Labels: labels, Taints: taints})
	if err != nil {
		return nil, fmt.Errorf("NodeClaim %s: %w", nodeClaim.Name, err)
	}
	return p.nodeClaimOf(m, it), nil
}

// cheapest is the type and offering of the lowest price among the types
// the NodeClaim's instance-type requirement names (Karpenter resolved its
// other requirements into that list) whose offerings reqs allow.
func cheapest(types []*cloudprovider.InstanceType, reqs scheduling.Requirements) (*cloudprovider.InstanceType, *cloudprovider.Offering) {
	var bestType *cloudprovider.InstanceType
	var best *cloudprovider.Offering
	named := reqs.Get(corev1.LabelInstanceTypeStable)
	for _, it := range types {
		if !named.Has(it.Name) {
			continue
		}
		for _, o := range it.Offerings.Available().Compatible(reqs) {
			if best == nil || o.Price < best.Price {
				bestType, best = it, o
			}
		}
	}
	return bestType, best
}

// nodeLabels are the NodeClaim's labels, its single-valued requirements,
// and the type's and offering's, as the node registers with them.
func nodeLabels(nodeClaim *karpv1.NodeClaim, it *cloudprovider.InstanceType, o *cloudprovider.Offering) map[string]string {
	out := maps.Clone(nodeClaim.Labels)
	if out == nil {
		out = map[string]string{}
	}
	for _, r := range nodeClaim.Spec.Requirements {
		if len(r.Values) == 1 && r.Operator == corev1.NodeSelectorOpIn {
			out[r.Key] = r.Values[0]
		}
	}
	for _, reqs := range []scheduling.Requirements{it.Requirements, o.Requirements} {
		for _, r := range reqs {
			if r.Len() == 1 && r.Operator() == corev1.NodeSelectorOpIn {
				out[r.Key] = r.Values()[0]
			}
		}
	}
	out[corev1.LabelHostname] = nodeClaim.Name
	return out
}

// nodeClaimOf is a machine as Karpenter's NodeClaim status says it.
func (p *CloudProvider) nodeClaimOf(m cloudapi.Machine, it *cloudprovider.InstanceType) *karpv1.NodeClaim {
	nc := &karpv1.NodeClaim{}
	nc.Name = m.Name
	nc.Labels = maps.Clone(m.Labels)
	nc.CreationTimestamp.Time = m.Created
	nc.Status.ProviderID = m.ProviderID
	if it != nil {
		nc.Status.Capacity = it.Capacity
		nc.Status.Allocatable = it.Allocatable()
	}
	return nc
}

// Delete terminates the NodeClaim's machine; NodeClaimNotFoundError once
// it is gone.
func (p *CloudProvider) Delete(ctx context.Context, nodeClaim *karpv1.NodeClaim) error {
	name, err := machineName(nodeClaim.Status.ProviderID)
	if err != nil {
		return cloudprovider.NewNodeClaimNotFoundError(err)
	}
	if err := p.cloud.Delete(ctx, name); err != nil {
		if errors.Is(err, ErrNotFound) {
			return cloudprovider.NewNodeClaimNotFoundError(err)
		}
		return err
	}
	return nil
}

// Get is the machine of a provider ID.
func (p *CloudProvider) Get(ctx context.Context, providerID string) (*karpv1.NodeClaim, error) {
	name, err := machineName(providerID)
	if err != nil {
		return nil, cloudprovider.NewNodeClaimNotFoundError(err)
	}
	m, err := p.cloud.Get(ctx, name)
	if err != nil {
		if errors.Is(err, ErrNotFound) {
			return nil, cloudprovider.NewNodeClaimNotFoundError(err)
		}
		return nil, err
	}
	return p.nodeClaimOf(m, nil), nil
}

// List is every machine of the cloud.
func (p *CloudProvider) List(ctx context.Context) ([]*karpv1.NodeClaim, error) {
	ms, err := p.cloud.List(ctx)
	if err != nil {
		return nil, err
	}
	out := make([]*karpv1.NodeClaim, 0, len(ms))
	for _, m := range ms {
		out = append(out, p.nodeClaimOf(m, nil))
	}
	return out, nil
}

// IsDrifted: a machine's configuration does not change after boot.
func (p *CloudProvider) IsDrifted(context.Context, *karpv1.NodeClaim) (cloudprovider.DriftReason, error) {
	return "", nil
}

// Reboot is not offered: devcluster's machines do not reboot in place.
func (p *CloudProvider) Reboot(context.Context, *karpv1.NodeClaim, string) error {
	return cloudprovider.NewNodeRebootNotImplementedError()
}

// RepairPolicies: none; gpudra's plugin taints an unhealthy GPU's
// devices, it does not replace the node.
func (p *CloudProvider) RepairPolicies() []cloudprovider.RepairPolicy { return nil }

func machineName(providerID string) (string, error) {
	name, ok := strings.CutPrefix(providerID, cloudapi.ProviderIDPrefix)
	if !ok || name == "" {
		return "", fmt.Errorf("provider ID %q is not devcluster's (%s<name>)", providerID, cloudapi.ProviderIDPrefix)
	}
	return name, nil
}
