package devcluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"sync/atomic"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"
	"sigs.k8s.io/yaml"

	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/devcluster/imagemode"
	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/devcluster/noderuntime"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
)

// The chart's workloads in image mode (imagemode.Options): devcluster plays
// the DaemonSet and Deployment controllers (it makes their pods from the
// rendered templates, unchanged) and the kubelet and container runtime
// that run them (package imagemode); the API server reaches the webhook
// through the chart's own Service and webhook configurations, by an
// EndpointSlice that names devcluster's front.

// ControlPlaneHost is the node name the controller's pods are bound to:
// the machine devcluster runs on, which has no kubelet and no Node object.
const ControlPlaneHost = "devcluster-control-plane"

// SimMachineFile is where, in each node's driver root, devcluster writes
// the node's simulated machine for the plugin run from the image
// (--backend sim --sim-machine /driver-root/<this>).
const SimMachineFile = "gpudra-sim-machine.yaml"

// imageChartValues are the chart values devcluster renders with in image
// mode: the simulated backend over each node's machine file, the nodes'
// CDI directories.
func imageChartValues(dir string) []string {
	nodeDir := filepath.Join(dir, "nodes", chart.NodeNamePlaceholder)
	return []string{"--set-string", "kubeletPlugin.backend=sim",
		"--set-string", "kubeletPlugin.simMachine=/driver-root/" + SimMachineFile,
		"--set-string", "kubeletPlugin.cdiDir=" + filepath.Join(nodeDir, "cdi")}
}

// ImagePodProcess is the host PID of the container of a pod run from the
// image, and its log (every start of it): for tests, which read what runs.
func (c *Cluster) ImagePodProcess(namespace, name string) (pid int, logPath string, err error) {
	if c.image == nil {
		return 0, "", errors.New("devcluster runs no pods from the image (imagemode.Options)")
	}
	return c.image.Process(namespace, name)
}

// ImageLogs are the logs of every pod run from the image, by pod.
func (c *Cluster) ImageLogs() map[string]string {
	if c.image == nil {
		return map[string]string{}
	}
	return c.image.Logs()
}

// chartPodTemplate is the pod template and replica count of the rendered
// chart's workload of this kind and name.
func (c *Cluster) chartPodTemplate(kind, name string) (*v1.PodTemplateSpec, int32, error) {
	objs, err := c.chartObjects(kind)
	if err != nil {
		return nil, 0, err
	}
	for _, o := range objs {
		if o.GetName() != name {
			continue
		}
		switch kind {
		case "DaemonSet":
			var ds appsv1.DaemonSet
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &ds); err != nil {
				return nil, 0, fmt.Errorf("the chart's DaemonSet %s: %w", name, err)
			}
			return &ds.Spec.Template, 1, nil
		case "Deployment":
			var d appsv1.Deployment
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &d); err != nil {
				return nil, 0, fmt.Errorf("the chart's Deployment %s: %w", name, err)
			}
			return &d.Spec.Template, ptr.Deref(d.Spec.Replicas, 1), nil
		}
	}
	return nil, 0, fmt.Errorf("the rendered chart (%s) has no %s %s", c.renderedChart(), kind, name)
}

// podFromTemplate is the pod a workload controller makes from its
// template.
func podFromTemplate(t *v1.PodTemplateSpec, name, node string) *v1.Pod {
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: chart.PluginNamespace, Labels: t.Labels, Annotations: t.Annotations},
		Spec: *t.Spec.DeepCopy()}
	pod.Spec.NodeName = node
	return pod
}

// runPluginPod runs the chart's kubelet plugin DaemonSet pod on the node,
// after writing the node's machine where the pod's --sim-machine finds it.
func (c *Cluster) runPluginPod(ctx context.Context, n *nodeagent.Node) error {
	if n.Machine == nil {
		return fmt.Errorf("node %s: image mode runs simulated machines only", n.Name)
	}
	spec, err := yaml.Marshal(n.Machine.Spec())
	if err != nil {
		return err
	}
	if _, err := sim.ParseSpec(spec); err != nil {
		return fmt.Errorf("node %s: the machine's spec does not read back: %w", n.Name, err)
	}
	if err := os.WriteFile(filepath.Join(n.DriverRoot(), SimMachineFile), spec, 0o644); err != nil {
		return err
	}
	t, _, err := c.chartPodTemplate("DaemonSet", chart.Release+"-kubelet-plugin")
	if err != nil {
		return err
	}
	pod := podFromTemplate(t, nodeagent.MetricsPodName(n.Name), n.Name)
	pod.OwnerReferences = []metav1.OwnerReference{*c.pluginOwner}
	_, err = c.image.RunPod(ctx, pod, n.Dir, nil)
	return err
}

// startImageController runs the chart's controller Deployment's pods and
// routes the chart's webhook Service to them.
func (c *Cluster) startImageController(ctx context.Context) error {
	c.gpudra = &controllers{serverName: WebhookConfigurationName + "." + chart.PluginNamespace + ".svc"}
	var err error
	if c.gpudra.front, err = nodeagent.ListenForPod(c.podNetwork()); err != nil {
		return fmt.Errorf("image mode: the webhook Service's endpoint, an address the API server dials: %w", err)
	}
	ip := c.gpudra.front.Addr().(*net.TCPAddr).IP.String()
	go c.gpudra.serve()
	objs, err := c.chartObjects("Service", "ValidatingWebhookConfiguration", "MutatingWebhookConfiguration")
	if err != nil {
		return err
	}
	var webhook []*unstructured.Unstructured
	for _, o := range objs {
		if o.GetName() == WebhookConfigurationName {
			webhook = append(webhook, o)
		}
	}
	if len(webhook) != 3 {
		return fmt.Errorf("the rendered chart has %d of the webhook's Service and two configurations named %s", len(webhook), WebhookConfigurationName)
	}
	if err := c.Apply(ctx, chart.PluginNamespace, webhook); err != nil {
		return fmt.Errorf("apply the chart's webhook: %w", err)
	}
	// As the EndpointSlice controller would write it for the ready
	// replicas, with devcluster's front as their one address.
	port := int32(c.gpudra.front.Addr().(*net.TCPAddr).Port) //nolint:gosec // a port
	slice := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: WebhookConfigurationName + "-devcluster", Namespace: chart.PluginNamespace,
			Labels: map[string]string{discoveryv1.LabelServiceName: WebhookConfigurationName, discoveryv1.LabelManagedBy: "devcluster.gpudra.dev"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{ip}, Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)}}},
		Ports:       []discoveryv1.EndpointPort{{Name: ptr.To("webhook"), Port: &port, Protocol: ptr.To(v1.ProtocolTCP)}},
	}
	if _, err := c.Client.DiscoveryV1().EndpointSlices(chart.PluginNamespace).Create(ctx, slice, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return fmt.Errorf("the webhook Service's EndpointSlice: %w", err)
	}
	t, replicas, err := c.chartPodTemplate("Deployment", chart.ControllerServiceAccount)
	if err != nil {
		return err
	}
	webhookPort, err := imagemode.ContainerPort(&t.Spec.Containers[0], intstr.FromString("webhook"))
	if err != nil {
		return fmt.Errorf("the chart's controller: %w", err)
	}
	for i := range replicas {
		var netns atomic.Value
		name := chart.ControllerServiceAccount + "-" + strconv.Itoa(int(i))
		p, err := c.image.RunPod(ctx, podFromTemplate(t, name, ControlPlaneHost), c.Dir, func(ns string) { netns.Store(ns) })
		if err != nil {
			return err
		}
		done := make(chan error, 1)
		go func() {
			<-p.Done()
			done <- nil
		}()
		r := &Controller{Name: name, Addr: "pod " + name, cancel: p.Cancel, done: done, isReady: p.Ready,
			dial: func(ctx context.Context) (net.Conn, error) {
				ns, started := netns.Load().(string)
				addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(webhookPort))
				switch {
				case !started:
					return nil, errors.New("not started")
				case ns == "": // hostNetwork
					var d net.Dialer
					return d.DialContext(ctx, "tcp", addr)
				}
				return noderuntime.DialInNetns(ctx, ns, addr)
			}}
		c.gpudra.mu.Lock()
		c.gpudra.replicas = append(c.gpudra.replicas, r)
		c.gpudra.mu.Unlock()
	}
	klog.FromContext(ctx).Info("The chart's controller runs from the image", "replicas", replicas, "webhookFront", c.gpudra.front.Addr().String())
	if err := c.WaitForWebhook(ctx, 90*time.Second); err != nil {
		return fmt.Errorf("the chart's controller pods (logs: %s): %w", c.image.LogDir(), err)
	}
	return c.waitGangPathDecided(ctx)
}
