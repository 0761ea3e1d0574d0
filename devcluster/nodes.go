package devcluster

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"slices"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	restclient "k8s.io/client-go/rest"
	"k8s.io/client-go/util/retry"

	"github.com/gpudra/gpudra/devcluster/cloudapi"
	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/devcluster/podnetwork"
)

// AddNode creates the Node object, starts the plugin over the simulated
// machine and the kubelet that serves it (nodeagent.Start).
func (c *Cluster) AddNode(ctx context.Context, opts nodeagent.NodeOptions) (*nodeagent.Node, error) {
	if opts.Machine == "" {
		opts.Machine = "dgx-h100"
	}
	switch opts.Mode {
	case "":
		opts.Mode = nodeagent.ModeDRA
	case nodeagent.ModeDRA, nodeagent.ModeDevicePlugin:
	default:
		return nil, fmt.Errorf("node %s: unknown mode %q, want %s or %s", opts.Name, opts.Mode, nodeagent.ModeDRA, nodeagent.ModeDevicePlugin)
	}
	if c.image != nil {
		if err := imageModeNode(opts); err != nil {
			return nil, err
		}
	}
	c.mu.Lock()
	if _, real := c.realNodes[opts.Name]; real {
		c.mu.Unlock()
		return nil, fmt.Errorf("node %q exists already (a real node)", opts.Name)
	}
	if _, dup := c.nodes[opts.Name]; dup {
		c.mu.Unlock()
		return nil, fmt.Errorf("node %q exists already", opts.Name)
	}
	c.mu.Unlock()
	n, err := nodeagent.Start(ctx, nodeagent.Env{Cluster: nodeHost{c}, Ctx: c.ctx, Dir: c.Dir, BootID: c.bootID, Admin: c.Client,
		MPSControlBinary: c.mpsControl, Runtime: c.runtime, Image: c.image != nil, PodNetwork: c.podNetwork(), PluginPodOwner: c.pluginOwner}, opts)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	c.nodes[opts.Name] = n
	c.order = append(c.order, opts.Name)
	c.mu.Unlock()
	return n, nil
}

// RemoveNode shuts a node started by AddNode down (nodeagent.Node.Stop: a
// terminated machine) and forgets it. The Node object and what the API
// holds of its pods stay for whoever manages the node to remove, as on a
// cluster whose machine went away.
func (c *Cluster) RemoveNode(name string) error {
	c.mu.Lock()
	n, ok := c.nodes[name]
	if ok {
		delete(c.nodes, name)
		c.order = slices.DeleteFunc(c.order, func(o string) bool { return o == name })
	}
	c.mu.Unlock()
	if !ok {
		return fmt.Errorf("node %q: %w", name, ErrNoSuchNode)
	}
	n.Stop()
	return nil
}

// ErrNoSuchNode: RemoveNode of a node devcluster does not run.
var ErrNoSuchNode = errors.New("no such node")

// imageModeNode refuses, before anything is made for the node, what image
// mode cannot give one node: the chart has one DaemonSet, in DRA mode, and
// its values are every node's.
func imageModeNode(opts nodeagent.NodeOptions) error {
	if opts.Mode != nodeagent.ModeDRA {
		return fmt.Errorf("node %s: image mode runs the chart's DRA plugin DaemonSet only", opts.Name)
	}
	if opts.Backend != nil {
		return fmt.Errorf("node %s: image mode runs simulated machines only", opts.Name)
	}
	if opts.FractionalGPUs || opts.MigDevices != nil || opts.UnhealthyTaintEffect != "" {
		return fmt.Errorf("node %s: FractionalGPUs, MigDevices and UnhealthyTaintEffect are the chart's values for every node in image mode (kubeletPlugin.fractionalGPUs, .migDevices, .unhealthyTaintEffect)", opts.Name)
	}
	return nil
}

// nodeHost is the cluster as its nodes see it (nodeagent.Cluster).
type nodeHost struct{ c *Cluster }

func (h nodeHost) CreateNode(ctx context.Context, opts nodeagent.NodeOptions) error {
	return h.c.createNodeObject(ctx, opts)
}

func (h nodeHost) KubeletClient(node string) (kubernetes.Interface, error) {
	return h.c.kubeletClientFor(node)
}

func (h nodeHost) NodeComponentConfig(ctx context.Context, sa, userAgent, node string) (*restclient.Config, error) {
	return h.c.nodeComponentConfig(ctx, sa, userAgent, node)
}

func (h nodeHost) RunPluginPod(ctx context.Context, n *nodeagent.Node) error {
	return h.c.runPluginPod(ctx, n)
}

func (c *Cluster) createNodeObject(ctx context.Context, opts nodeagent.NodeOptions) error {
	// A zone and a region, as every cloud's node has: the API server
	// copies them onto the pods created there (PodTopologyLabelsAdmission),
	// MPS server pods included (docs/security.md).
	labels := map[string]string{"kubernetes.io/hostname": opts.Name, "kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64",
		"gpu.gpudra.dev/present": "true", v1.LabelTopologyZone: cloudapi.Zone, v1.LabelTopologyRegion: cloudapi.Region}
	if opts.Mode == nodeagent.ModeDevicePlugin {
		labels[nodeagent.DevicePluginModeLabel] = nodeagent.ModeDevicePlugin
	}
	for k, v := range opts.Labels {
		labels[k] = v
	}
	capacity := v1.ResourceList{
		v1.ResourceCPU: resource.MustParse(nodeagent.NodeCPU), v1.ResourceMemory: resource.MustParse(nodeagent.NodeMemory),
		v1.ResourcePods: *resource.NewQuantity(int64(cmp.Or(opts.MaxPods, 110)), resource.DecimalSI), v1.ResourceEphemeralStorage: resource.MustParse(nodeagent.NodeEphemeralStorage),
	}
	// The taints are on the Node from its creation, as the kubelet's
	// --register-with-taints puts them: an autoscaler that registers the
	// node (Karpenter removes karpenter.sh/unregistered) may do so the
	// moment it appears, and no later write of ours may put a taint back.
	node := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: opts.Name, Labels: labels, Annotations: opts.Annotations},
		Spec: v1.NodeSpec{ProviderID: opts.ProviderID, Taints: opts.Taints}}
	node, err := c.Client.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{})
	if err != nil {
		return fmt.Errorf("create Node %s: %w", opts.Name, err)
	}
	// Others write the Node from its first moment (an autoscaler that
	// registers it): each write of ours is to the Node as it is now.
	now := metav1.Now()
	status := v1.NodeStatus{
		Capacity: capacity, Allocatable: capacity, Phase: v1.NodeRunning,
		Conditions: []v1.NodeCondition{{Type: v1.NodeReady, Status: v1.ConditionTrue, Reason: "KubeletReady",
			Message: "devcluster kubelet is ready", LastHeartbeatTime: now, LastTransitionTime: now}},
		Addresses: []v1.NodeAddress{{Type: v1.NodeInternalIP, Address: "127.0.0.1"}, {Type: v1.NodeHostName, Address: opts.Name}},
		NodeInfo:  v1.NodeSystemInfo{KubeletVersion: "v1.37.1", OperatingSystem: "linux", Architecture: "amd64", ContainerRuntimeVersion: "devcluster://0"},
	}
	first := true
	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		if !first {
			fresh, err := c.Client.CoreV1().Nodes().Get(ctx, opts.Name, metav1.GetOptions{})
			if err != nil {
				return err
			}
			node = fresh
		}
		first = false
		node.Status = status
		_, err := c.Client.CoreV1().Nodes().UpdateStatus(ctx, node, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		return fmt.Errorf("Node %s status: %w", opts.Name, err)
	}
	// Admission taints a new Node not-ready; no node lifecycle controller
	// runs here to lift it once the node reports Ready. Only that taint
	// goes, from the Node as it is now: others may have changed it since.
	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		node, err := c.Client.CoreV1().Nodes().Get(ctx, opts.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		taints := slices.DeleteFunc(slices.Clone(node.Spec.Taints), func(t v1.Taint) bool { return t.Key == v1.TaintNodeNotReady })
		if len(taints) == len(node.Spec.Taints) {
			return nil
		}
		node.Spec.Taints = taints
		_, err = c.Client.CoreV1().Nodes().Update(ctx, node, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		return fmt.Errorf("Node %s: lift the not-ready taint: %w", opts.Name, err)
	}
	return nil
}

// kubeletClientFor is the node's kubelet client: the kubelet's own
// identity (user system:node:<node>, group system:nodes), held to what the
// Node authorizer and NodeRestriction admission allow a kubelet, at the
// limits the plugin uses. Its 403s are not recorded as the components'
// are: the Node authorizer learns a pod's claims a moment after the pod is
// bound, so a kubelet meets (and retries) transient 403s, as on a real
// node.
func (c *Cluster) kubeletClientFor(node string) (kubernetes.Interface, error) {
	cfg := restclient.AddUserAgent(restclient.CopyConfig(c.RESTConfig), "kubelet/"+node)
	cfg.Impersonate = restclient.ImpersonationConfig{UserName: "system:node:" + node, Groups: []string{"system:nodes", "system:authenticated"}}
	cfg.QPS, cfg.Burst = 50, 100
	return kubernetes.NewForConfig(cfg)
}

// podNetwork is the pod network for a node's in-process pods; nil (the
// machine's own address) without one.
func (c *Cluster) podNetwork() nodeagent.PodNetwork {
	if c.podNet == nil {
		return nil
	}
	return c.podNet
}

// DialPodNetwork connects to addr as a pod on devcluster's pod network
// would (from the namespace that holds the address), or, without a pod
// network, from this machine.
func (c *Cluster) DialPodNetwork(ctx context.Context, addr string) (net.Conn, error) {
	if c.podNet == nil {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", addr)
	}
	return c.podNet.Dial(ctx, addr)
}

// PodNetworkAddress is the address of the pods devcluster serves itself on
// its pod network (podnetwork.Address), or "" where there is none and they
// listen on the machine's own address.
func (c *Cluster) PodNetworkAddress() string {
	if c.podNet == nil {
		return ""
	}
	return podnetwork.Address
}
