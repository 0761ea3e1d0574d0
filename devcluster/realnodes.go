package devcluster

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/util/retry"
	"k8s.io/component-helpers/scheduling/corev1/nodeaffinity"
	"k8s.io/klog/v2"
	"sigs.k8s.io/yaml"

	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/devcluster/controlplane"
	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/devcluster/realnode"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// RealNodeOptions describe a node run by the kubelet binary and containerd
// (package realnode) beside the simulated ones.
type RealNodeOptions struct {
	Name     string
	Binaries realnode.Binaries
	// Image is make image's docker tarball for this machine's
	// architecture: with it, the chart's kubelet plugin DaemonSet pod runs
	// on the node from that image, under the real kubelet, over the
	// simulated Machine (default dgx-h100-nomig) in the node's driver
	// root. Empty: no plugin.
	Image   string
	Machine string
	// Labels and Taints are the kubelet's --node-labels and
	// --register-with-taints (a label below kubernetes.io or k8s.io is
	// refused by NodeRestriction, as on any node).
	Labels map[string]string
	Taints []v1.Taint
	// Annotations are set on the Node once it registers, before the
	// plugin starts, as an admin would (gpu.gpudra.dev/mig-devices: the
	// node's own MIG policy).
	Annotations map[string]string
}

// AddRealNode starts a real node and waits until its kubelet has
// registered the Node and reports it Ready. The kubelet authenticates with
// a client certificate for system:node:<name> (group system:nodes) from
// the cluster's client CA (Options.RealNodes), so the Node authorizer and
// NodeRestriction hold it as they hold any kubelet.
func (c *Cluster) AddRealNode(ctx context.Context, opts RealNodeOptions) (*realnode.Node, error) {
	if c.clientCA == nil {
		return nil, errors.New("real nodes need Options.RealNodes: the API server trusts devcluster's node client CA only then")
	}
	if errs := validation.IsDNS1123Subdomain(opts.Name); len(errs) > 0 {
		return nil, fmt.Errorf("real node %q: %s", opts.Name, strings.Join(errs, "; "))
	}
	// The plugin's DRA socket during a rolling update is the longest path
	// it binds (pkg/plugin's socketPaths): say so now, not in the plugin
	// pod's crash loop.
	nodeDir := filepath.Join(c.Dir, "nodes", opts.Name)
	if sock := filepath.Join(nodeDir, "plugins", slicebuilder.DriverName, "dra-"+strings.Repeat("u", 36)+".sock"); len(sock) > maxSocketPath {
		return nil, fmt.Errorf("real node %q: the plugin's socket under %s would be %d bytes, over the %d a unix socket path may have: a shorter node name or devcluster directory", opts.Name, nodeDir, len(sock), maxSocketPath)
	}
	// The name and the pods' subnet are this node's from here on; Stop
	// skips a node still starting (nil).
	c.mu.Lock()
	if _, dup := c.nodes[opts.Name]; dup {
		c.mu.Unlock()
		return nil, fmt.Errorf("node %q exists already", opts.Name)
	}
	if _, dup := c.realNodes[opts.Name]; dup {
		c.mu.Unlock()
		return nil, fmt.Errorf("node %q exists already", opts.Name)
	}
	index := len(c.realNodes)
	c.realNodes[opts.Name] = nil
	c.mu.Unlock()
	cert, key, err := c.clientCA.Issue("system:node:"+opts.Name, "system:nodes")
	if err != nil {
		return nil, err
	}
	u, err := url.Parse(c.RESTConfig.Host)
	if err != nil {
		return nil, err
	}
	ca, err := controlplane.ServingCA(u.Host)
	if err != nil {
		return nil, err
	}
	// The chart's per-node paths (chart.Render): the kubelet's root is the
	// node's directory, with the CDI specs and the driver root below it.
	vip, err := c.kubernetesServiceAddress(ctx)
	if err != nil {
		return nil, err
	}
	ropts := realnode.Options{Name: opts.Name, Dir: filepath.Join(c.Dir, "r", opts.Name), Binaries: opts.Binaries,
		APIServer: c.RESTConfig.Host, CA: ca, Cert: cert, Key: key, KubeletRootDir: nodeDir, APIServerVIP: vip,
		CDIDirs: []string{filepath.Join(nodeDir, "cdi")}, PodSubnet: fmt.Sprintf("10.244.%d.0/24", index)}
	if opts.Image != "" {
		if err := writeSimulatedDriver(filepath.Join(nodeDir, "driver"), opts.Name, cmp.Or(opts.Machine, "dgx-h100-nomig"), opts.Binaries.MPSControl); err != nil {
			return nil, fmt.Errorf("real node %s: %w", opts.Name, err)
		}
		ropts.Images = []realnode.Tarball{{File: opts.Image, Ref: chart.MPSServerImage}}
		// What the GPU operator labels a GPU node with, which the chart's
		// default affinity selects (Node Feature Discovery's label is below
		// kubernetes.io, which NodeRestriction keeps from a kubelet).
		ropts.Labels = map[string]string{"nvidia.com/gpu.present": "true"}
	}
	if len(opts.Labels) > 0 && ropts.Labels == nil {
		ropts.Labels = map[string]string{}
	}
	maps.Copy(ropts.Labels, opts.Labels)
	ropts.Taints = opts.Taints
	dir := ropts.Dir
	n, err := realnode.Start(ctx, ropts)
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	c.realNodes[opts.Name] = n
	c.mu.Unlock()
	// The API server reaches the node's pods (pods/proxy, webhooks)
	// through the pod network's egress proxy, in containerd's namespace.
	if c.podNet != nil {
		if err := c.podNet.AddRoute(ropts.PodSubnet, n.Netns()); err != nil {
			return n, err
		}
	}
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		node, err := c.Client.CoreV1().Nodes().Get(ctx, opts.Name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		for _, cond := range node.Status.Conditions {
			if cond.Type == v1.NodeReady {
				return cond.Status == v1.ConditionTrue, nil
			}
		}
		return false, nil
	})
	if err != nil {
		return n, fmt.Errorf("real node %s is not Ready (kubelet log: %s): %w", opts.Name, filepath.Join(dir, "kubelet.log"), err)
	}
	// Admission taints a new Node not-ready, and no node lifecycle
	// controller runs here to lift it (it would also judge the simulated
	// nodes, whose stand-in kubelet sends no heartbeats): devcluster lifts
	// it once the kubelet reports Ready, as that controller does.
	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		node, err := c.Client.CoreV1().Nodes().Get(ctx, opts.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		taints := slices.DeleteFunc(slices.Clone(node.Spec.Taints), func(t v1.Taint) bool { return t.Key == v1.TaintNodeNotReady })
		if len(taints) == len(node.Spec.Taints) && len(opts.Annotations) == 0 {
			return nil
		}
		node.Spec.Taints = taints
		if len(opts.Annotations) > 0 && node.Annotations == nil {
			node.Annotations = map[string]string{}
		}
		maps.Copy(node.Annotations, opts.Annotations)
		_, err = c.Client.CoreV1().Nodes().Update(ctx, node, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		return n, fmt.Errorf("real node %s: lift the not-ready taint, annotate: %w", opts.Name, err)
	}
	if opts.Image != "" {
		if err := c.RunRealPluginPod(ctx, opts.Name, nodeagent.MetricsPodName(opts.Name)); err != nil {
			return n, fmt.Errorf("real node %s: %w", opts.Name, err)
		}
		feedCtx, cancel := context.WithCancel(klog.NewContext(c.ctx, klog.FromContext(ctx)))
		done := make(chan struct{})
		go func() { defer close(done); c.feedRealNodeLoads(feedCtx, n, filepath.Join(nodeDir, "driver")) }()
		c.mu.Lock()
		c.realNodeFeeds = append(c.realNodeFeeds, func() { cancel(); <-done })
		c.mu.Unlock()
	}
	return n, nil
}

// maxSocketPath is the longest path a unix socket may have on Linux.
const maxSocketPath = 107

// kubernetesServiceAddress is the kubernetes Service's ClusterIP and port,
// which the kubelet gives every pod as KUBERNETES_SERVICE_HOST and _PORT.
func (c *Cluster) kubernetesServiceAddress(ctx context.Context) (string, error) {
	var addr string
	err := wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 30*time.Second, true, func(ctx context.Context) (bool, error) {
		svc, err := c.Client.CoreV1().Services("default").Get(ctx, "kubernetes", metav1.GetOptions{})
		if err != nil || svc.Spec.ClusterIP == "" || len(svc.Spec.Ports) == 0 {
			return false, nil
		}
		addr = net.JoinHostPort(svc.Spec.ClusterIP, strconv.Itoa(int(svc.Spec.Ports[0].Port)))
		return true, nil
	})
	if err != nil {
		return "", fmt.Errorf("the kubernetes Service: %w", err)
	}
	return addr, nil
}

// writeSimulatedDriver lays out a simulated machine's driver root, marked
// as such, with the machine's spec where the chart's plugin reads it
// (--sim-machine /driver-root/<SimMachineFile>), as image mode does, and
// mpsControl (if any) as its nvidia-cuda-mps-control, where the plugin's
// default and the chart's admission policy for MPS server pods look.
func writeSimulatedDriver(root, node, machine, mpsControl string) error {
	m, err := sim.NewBuiltin(machine, node)
	if err != nil {
		return err
	}
	if err := m.WriteDriverRoot(root, sim.DriverStandIns{}); err != nil {
		return err
	}
	if mpsControl != "" {
		b, err := os.ReadFile(mpsControl)
		if err != nil {
			return fmt.Errorf("the MPS control stand-in: %w", err)
		}
		if err := os.WriteFile(filepath.Join(root, sim.BinDir, "nvidia-cuda-mps-control"), b, 0o755); err != nil { //nolint:gosec // an executable
			return err
		}
	}
	spec, err := yaml.Marshal(m.Spec())
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(root, SimMachineFile), spec, 0o644)
}

// RunRealPluginPod creates a pod of the chart's kubelet plugin DaemonSet on
// the real node, named podName, as the DaemonSet controller would, and
// waits until it is Ready (the kubelet's probes of its /healthz pass) and
// the node's pool is published. A second one on
// the same node is a rolling update's surge: both run side by side, each
// registered under its own pod UID. devcluster renders the chart with per-node host
// paths ($(NODE_NAME), chart.NodeNamePlaceholder): it puts the node's name
// there, where a real cluster's chart has one path for every node.
func (c *Cluster) RunRealPluginPod(ctx context.Context, node, podName string) error {
	n := c.RealNode(node)
	if n == nil {
		return fmt.Errorf("no real node %s", node)
	}
	// The chart's DaemonSet for the node, as the DaemonSet controller
	// picks it: the one whose required node affinity the Node matches
	// (kubeletPlugin.mode and the node's gpu.gpudra.dev/mode label choose
	// between <release>-kubelet-plugin and <release>-device-plugin, which
	// publishes no slices).
	nodeObj, err := c.Client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		return err
	}
	var t *v1.PodTemplateSpec
	devicePluginMode := false
	for _, name := range []string{chart.Release + "-kubelet-plugin", chart.Release + "-device-plugin"} {
		tmpl, _, err := c.chartPodTemplate("DaemonSet", name)
		if err != nil {
			continue // not rendered in this mode
		}
		if match, err := nodeaffinity.GetRequiredNodeAffinity(&v1.Pod{Spec: tmpl.Spec}).Match(nodeObj); err == nil && match {
			t, devicePluginMode = tmpl, strings.HasSuffix(name, "-device-plugin")
			break
		}
	}
	if t == nil {
		return fmt.Errorf("no DaemonSet of the chart (%s-kubelet-plugin, %s-device-plugin) selects node %s (labels %v)", chart.Release, chart.Release, node, nodeObj.Labels)
	}
	// Its ConfigMaps (the device plugin's config), as helm installs them.
	cms, err := c.chartObjects("ConfigMap")
	if err != nil {
		return err
	}
	if err := c.Apply(ctx, chart.PluginNamespace, cms); err != nil {
		return fmt.Errorf("the chart's ConfigMaps: %w", err)
	}
	pod := podFromTemplate(t, podName, node)
	for i := range pod.Spec.Volumes {
		hp := pod.Spec.Volumes[i].HostPath
		if hp == nil {
			continue
		}
		hp.Path = strings.ReplaceAll(hp.Path, chart.NodeNamePlaceholder, node)
		// The kubelet's device manager serves at its fixed path, not
		// below the root directory the chart was rendered with.
		if pod.Spec.Volumes[i].Name == "device-plugins" {
			hp.Path = realnode.KubeletDevicePluginDir
		}
	}
	for _, cs := range [][]v1.Container{pod.Spec.InitContainers, pod.Spec.Containers} {
		for i := range cs {
			for j := range cs[i].VolumeMounts {
				cs[i].VolumeMounts[j].MountPath = strings.ReplaceAll(cs[i].VolumeMounts[j].MountPath, chart.NodeNamePlaceholder, node)
			}
		}
	}
	if _, err := c.Client.CoreV1().Pods(chart.PluginNamespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("the chart's plugin pod: %w", err)
	}
	var last string
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		p, err := c.Client.CoreV1().Pods(chart.PluginNamespace).Get(ctx, pod.Name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		last = fmt.Sprintf("%s %s: %s %+v", p.Status.Phase, p.Status.Reason, p.Status.Message, p.Status.ContainerStatuses)
		if p.Status.Phase == v1.PodFailed {
			return false, fmt.Errorf("the kubelet failed it: %s: %s", p.Status.Reason, p.Status.Message)
		}
		list, err := c.Client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		ready := false
		for _, cond := range p.Status.Conditions {
			ready = ready || (cond.Type == v1.PodReady && cond.Status == v1.ConditionTrue)
		}
		if devicePluginMode {
			// Published is the node's allocatable extended resource.
			n, err := c.Client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
			if err != nil {
				return false, nil
			}
			for name, q := range n.Status.Allocatable {
				if strings.HasPrefix(string(name), "nvidia.com/") && !q.IsZero() {
					return ready, nil
				}
			}
			return false, nil
		}
		for _, s := range list.Items {
			if s.Spec.Pool.Name == node {
				return ready, nil
			}
		}
		return false, nil
	})
	if err != nil {
		return fmt.Errorf("the chart's plugin pod is not Ready (its probes: /healthz) and publishing (%s; its log: %s): %w", last,
			n.ContainerLog(chart.PluginNamespace, pod.Name, "plugin", 20), err)
	}
	return nil
}
