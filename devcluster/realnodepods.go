package devcluster

import (
	"context"
	"errors"
	"fmt"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/wait"

	"github.com/gpudra/gpudra/devcluster/noderuntime"
	"github.com/gpudra/gpudra/devcluster/realnode"
	"github.com/gpudra/gpudra/pkg/probe"
)

// PinToRealNode rewrites example manifests to run on a real node: each
// Pod, and the pod template of each workload, gets a node selector for the
// node, and each of its containers runs the probe image (realnode.ProbeImage,
// never pulled) in place of its image and command. The examples name a
// CUDA image that nothing here can pull, and their command (bash -c
// "nvidia-smi -L ...") needs a shell that image has; the probe instead
// reports what containerd gave the container. Claims, tolerations, labels
// and the containers' environment stay as written. Kinds whose pods sit
// elsewhere (Grove's PodCliqueSet) are refused by name.
func PinToRealNode(objs []*unstructured.Unstructured, node string) error {
	for _, obj := range objs {
		var path []string
		switch obj.GetKind() {
		case "Pod":
			path = []string{"spec"}
		case "Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job":
			path = []string{"spec", "template", "spec"}
		case "PodCliqueSet", "PodClique":
			return fmt.Errorf("%s %s: its pods are made by Grove's operator; pin them there", obj.GetKind(), obj.GetName())
		default:
			continue
		}
		spec, found, err := unstructured.NestedMap(obj.Object, path...)
		if err != nil || !found {
			return fmt.Errorf("%s %s: no pod spec at %v: %v", obj.GetKind(), obj.GetName(), path, err)
		}
		selector, _, _ := unstructured.NestedStringMap(spec, "nodeSelector")
		if selector == nil {
			selector = map[string]string{}
		}
		selector[v1.LabelHostname] = node
		if err := unstructured.SetNestedStringMap(spec, selector, "nodeSelector"); err != nil {
			return fmt.Errorf("%s %s: %w", obj.GetKind(), obj.GetName(), err)
		}
		for _, field := range []string{"initContainers", "containers"} {
			containers, _, err := unstructured.NestedSlice(spec, field)
			if err != nil {
				return fmt.Errorf("%s %s: %s: %w", obj.GetKind(), obj.GetName(), field, err)
			}
			for i, c := range containers {
				m, ok := c.(map[string]any)
				if !ok {
					return fmt.Errorf("%s %s: %s[%d] is no object", obj.GetKind(), obj.GetName(), field, i)
				}
				m["image"] = realnode.ProbeImage
				m["imagePullPolicy"] = string(v1.PullNever)
				delete(m, "command")
				delete(m, "args")
			}
			if containers != nil {
				if err := unstructured.SetNestedSlice(spec, containers, field); err != nil {
					return fmt.Errorf("%s %s: %w", obj.GetKind(), obj.GetName(), err)
				}
			}
		}
		if err := unstructured.SetNestedMap(obj.Object, spec, path...); err != nil {
			return fmt.Errorf("%s %s: %w", obj.GetKind(), obj.GetName(), err)
		}
	}
	return nil
}

// RealNode is the running real node of that name, or nil.
func (c *Cluster) RealNode(name string) *realnode.Node {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.realNodes[name]
}

// RealProbeReports are the probe reports of a pod's containers on a real
// node, read from the kubelet's pod logs; they wait up to timeout for
// each container's first report. nil, nil: the pod is on no real node.
func (c *Cluster) RealProbeReports(ctx context.Context, pod *v1.Pod, timeout time.Duration) (map[string]*probe.Report, error) {
	n := c.RealNode(pod.Spec.NodeName)
	if n == nil {
		return nil, nil
	}
	out := map[string]*probe.Report{}
	for _, ctr := range pod.Spec.Containers {
		var last error
		err := wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, timeout, true, func(context.Context) (bool, error) {
			r, err := n.ProbeReport(pod.Namespace, pod.Name, string(pod.UID), ctr.Name)
			if err != nil {
				last = err
				return false, nil
			}
			out[ctr.Name] = r
			return true, nil
		})
		if err != nil {
			return out, errors.Join(last, err)
		}
	}
	return out, nil
}

// AddRealNodeViews fills in, for the reported pods that run on a real
// node, what each container's probe reported from inside, read from the
// kubelet's pod logs: devcluster's own kubelet records it on the pod, the
// real one does not. The GPUs it sees are named from the identities its
// CDI devices put in its environment, not from its device nodes: the MIG
// devices the plugin made live in the plugin's process, where devcluster
// cannot look them up (the FROM INSIDE column shows the nodes).
func (c *Cluster) AddRealNodeViews(ctx context.Context, reports []PodReport) error {
	for i := range reports {
		r := &reports[i]
		if c.RealNode(r.Node) == nil || r.Phase != v1.PodRunning {
			continue
		}
		pod, err := c.Client.CoreV1().Pods(r.Namespace).Get(ctx, r.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		inside, err := c.RealProbeReports(ctx, pod, 10*time.Second)
		if err != nil {
			return fmt.Errorf("pod %s/%s: %w", r.Namespace, r.Name, err)
		}
		if r.Containers == nil {
			r.Containers = map[string]noderuntime.ContainerView{}
		}
		for name, rep := range inside {
			view := r.Containers[name]
			view.Report = rep
			// The identities gpudra's CDI specs gave the container
			// (GPUDRA_<device>_UUID), as it saw them in its environment.
			view.GPUs = DeviceIdentities(rep)
			r.Containers[name] = view
		}
	}
	return nil
}
