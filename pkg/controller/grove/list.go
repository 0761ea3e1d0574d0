package grove

import (
	"context"
	"fmt"
	"sort"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/client-go/kubernetes"

	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// ListGroups reads the Grove sharing groups of gpudra in namespace (all
// namespaces when empty) from the API and analyses them as the controller
// does, with each device's UUID from the ResourceSlices. Nodes and slices
// are optional: without the right to read them, Node comes from the
// allocation's selector and UUIDs stay empty.
func ListGroups(ctx context.Context, client kubernetes.Interface, namespace string, now time.Time) ([]Group, error) {
	claims, err := client.ResourceV1().ResourceClaims(namespace).List(ctx, metav1.ListOptions{
		LabelSelector: labels.Set{LabelManagedBy: ManagedByGrove, LabelComponent: ComponentResourceClaim}.String(),
	})
	if err != nil {
		return nil, fmt.Errorf("list Grove ResourceClaims: %w", err)
	}
	var ours []*resourceapi.ResourceClaim
	for i := range claims.Items {
		if c := &claims.Items[i]; IsGroveClaim(c) && IsOurs(c) {
			ours = append(ours, c)
		}
	}
	if len(ours) == 0 {
		return []Group{}, nil
	}
	podList, err := client.CoreV1().Pods(namespace).List(ctx, metav1.ListOptions{
		LabelSelector: labels.Set{LabelManagedBy: ManagedByGrove}.String(),
	})
	if err != nil {
		return nil, fmt.Errorf("list Grove pods: %w", err)
	}
	pods := make([]*corev1.Pod, 0, len(podList.Items))
	for i := range podList.Items {
		pods = append(pods, &podList.Items[i])
	}
	var nodes []*corev1.Node
	nodeList, err := client.CoreV1().Nodes().List(ctx, metav1.ListOptions{})
	switch {
	case apierrors.IsForbidden(err):
	case err != nil:
		return nil, fmt.Errorf("list nodes: %w", err)
	default:
		for i := range nodeList.Items {
			nodes = append(nodes, &nodeList.Items[i])
		}
	}
	uuids, err := deviceUUIDs(ctx, client)
	if err != nil {
		return nil, err
	}
	out := make([]Group, 0, len(ours))
	for _, c := range ours {
		g, _ := Analyze(Input{Claim: c, Pods: pods, Nodes: nodes, Now: now})
		for i := range g.Devices {
			g.Devices[i].UUID = uuids[g.Devices[i].Pool+"/"+g.Devices[i].Device]
		}
		out = append(out, g)
	}
	sort.Slice(out, func(i, j int) bool {
		if out[i].Namespace != out[j].Namespace {
			return out[i].Namespace < out[j].Namespace
		}
		return out[i].Claim < out[j].Claim
	})
	return out, nil
}

// deviceUUIDs maps pool/device to the uuid attribute our slices publish.
func deviceUUIDs(ctx context.Context, client kubernetes.Interface) (map[string]string, error) {
	slices, err := client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("spec.driver", slicebuilder.DriverName).String(),
	})
	if apierrors.IsForbidden(err) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("list ResourceSlices: %w", err)
	}
	out := map[string]string{}
	for _, s := range slices.Items {
		if s.Spec.Driver != slicebuilder.DriverName {
			continue
		}
		for _, d := range s.Spec.Devices {
			if a, ok := d.Attributes["uuid"]; ok && a.StringValue != nil {
				out[s.Spec.Pool.Name+"/"+d.Name] = *a.StringValue
			}
		}
	}
	return out, nil
}
