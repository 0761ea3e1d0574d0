package nodeagent

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"sync"
	"time"

	v1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes"
	restclient "k8s.io/client-go/rest"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/pkg/metrics"
)

// A node's plugin runs in this process, not as a pod, so nothing in the
// cluster would say where its /metrics is. The metrics pod stands in for
// the chart's DaemonSet pod: it carries the chart's kubelet-plugin labels
// and a container port named metrics, and the devcluster kubelet marks it
// Running with the address this process serves the node's registry on.
// The API server's pods proxy (GET .../pods/NAME:PORT/proxy/metrics) then
// reaches the node's telemetry as it reaches a real plugin pod's, which is
// how gpudra dashboard reads usage.

// PodIPAnnotation gives the devcluster kubelet the IP to report for a pod
// whose server runs in this process (a metrics pod).
const PodIPAnnotation = "devcluster.gpudra.dev/pod-ip"

// MetricsPodName is the metrics pod of a node.
func MetricsPodName(node string) string { return "gpudra-kubelet-plugin-" + node }

// PluginPodLabels are the chart's labels on its kubelet plugin pods
// (templates/_helpers.tpl, gpudra.pluginSelectorLabels).
func PluginPodLabels() map[string]string {
	return map[string]string{"app.kubernetes.io/name": "gpudra", "app.kubernetes.io/instance": chart.Release,
		"app.kubernetes.io/component": "kubelet-plugin"}
}

// MetricsPort is the name of the plugin container's metrics port, as in
// the chart; it serves HTTPS, and HealthPath to anyone (the probes).
const (
	MetricsPort = "metrics"
	HealthPath  = "/healthz"
)

var hostIP struct {
	once sync.Once
	ip   string
	err  error
}

// ListenForPod listens, for a pod served in this process, on a free port
// of the pod network, or without one of the machine's proxyable address.
func ListenForPod(pods PodNetwork) (net.Listener, error) {
	if pods != nil {
		return pods.Listen()
	}
	ip, err := ProxyableHostIP()
	if err != nil {
		return nil, err
	}
	return net.Listen("tcp", net.JoinHostPort(ip, "0"))
}

// ProxyableHostIP is an address of this machine that kube-apiserver
// agrees to proxy to: it refuses loopback and link-local pod IPs
// (k8s.io/apimachinery/pkg/util/proxy IsProxyableIP), so the first
// global unicast IPv4 address of an interface that is up.
func ProxyableHostIP() (string, error) {
	hostIP.once.Do(func() {
		ifaces, err := net.Interfaces()
		if err != nil {
			hostIP.err = fmt.Errorf("list network interfaces: %w", err)
			return
		}
		for _, iface := range ifaces {
			if iface.Flags&net.FlagUp == 0 || iface.Flags&net.FlagLoopback != 0 {
				continue
			}
			addrs, err := iface.Addrs()
			if err != nil {
				continue
			}
			for _, a := range addrs {
				ipn, ok := a.(*net.IPNet)
				if ok && ipn.IP.To4() != nil && ipn.IP.IsGlobalUnicast() {
					hostIP.ip = ipn.IP.String()
					return
				}
			}
		}
		hostIP.err = errors.New("no interface with a global unicast IPv4 address: kube-apiserver proxies to no loopback or link-local pod IP")
	})
	return hostIP.ip, hostIP.err
}

// serveMetricsPod serves the node's registry on the pod network (or,
// without one, on this machine's proxyable address) and creates its
// metrics pod, until the node's context ends. It serves what the plugin's
// binary serves (cmd/kubelet-plugin, metricsServer): HTTPS with a
// self-signed certificate, /metrics only to those the API server
// authenticates and RBAC lets get it, reviewed as the plugin's
// ServiceAccount (pluginCfg), /healthz to anyone.
func (n *Node) serveMetricsPod(ctx context.Context, admin kubernetes.Interface, pods PodNetwork, pluginCfg *restclient.Config, owner *metav1.OwnerReference) error {
	auth, err := metrics.NewKubernetesAuth(pluginCfg)
	if err != nil {
		return fmt.Errorf("node %s: metrics pod: %w", n.Name, err)
	}
	tlsConfig, err := metrics.SelfSignedTLS(MetricsPodName(n.Name))
	if err != nil {
		return fmt.Errorf("node %s: metrics pod: %w", n.Name, err)
	}
	ln, err := ListenForPod(pods)
	if err != nil {
		return fmt.Errorf("node %s: metrics pod: %w", n.Name, err)
	}
	ip := ln.Addr().(*net.TCPAddr).IP.String()
	mux := http.NewServeMux()
	mux.Handle("/metrics", metrics.Handler(n.metrics))
	mux.HandleFunc(HealthPath, func(w http.ResponseWriter, _ *http.Request) { _, _ = w.Write([]byte("ok")) })
	srv := &http.Server{Handler: auth.Protect(mux, HealthPath), ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(tls.NewListener(ln, tlsConfig)) }()
	go func() {
		<-n.ctx.Done()
		_ = srv.Close()
	}()
	port := ln.Addr().(*net.TCPAddr).Port
	pod := &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{Name: MetricsPodName(n.Name), Namespace: chart.PluginNamespace, Labels: PluginPodLabels(),
			Annotations: map[string]string{PodIPAnnotation: ip}},
		Spec: v1.PodSpec{NodeName: n.Name, Containers: []v1.Container{{
			Name: "plugin", Image: "gpudra:devcluster", Command: []string{"gpudra-kubelet-plugin"},
			Ports: []v1.ContainerPort{{Name: MetricsPort, ContainerPort: int32(port), Protocol: v1.ProtocolTCP}},
			// As the chart's: what gpudra dashboard reads the scheme from.
			LivenessProbe: &v1.Probe{ProbeHandler: v1.ProbeHandler{HTTPGet: &v1.HTTPGetAction{
				Path: HealthPath, Port: intstr.FromString(MetricsPort), Scheme: v1.URISchemeHTTPS}}},
		}}},
	}
	if owner != nil {
		pod.OwnerReferences = []metav1.OwnerReference{*owner}
	}
	err = admin.CoreV1().Pods(chart.PluginNamespace).Delete(ctx, pod.Name, metav1.DeleteOptions{GracePeriodSeconds: new(int64)})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("node %s: metrics pod: %w", n.Name, err)
	}
	if _, err := admin.CoreV1().Pods(chart.PluginNamespace).Create(ctx, pod, metav1.CreateOptions{}); err != nil {
		return fmt.Errorf("node %s: metrics pod: %w", n.Name, err)
	}
	klog.FromContext(ctx).V(2).Info("Metrics pod created", "node", n.Name, "address", net.JoinHostPort(ip, strconv.Itoa(port)))
	return nil
}

// inProcessPod says whether the pod's server runs in this process: the
// kubelet starts nothing for it and reports the pod's IP.
func inProcessPod(pod *v1.Pod) bool { return pod.Annotations[PodIPAnnotation] != "" }
