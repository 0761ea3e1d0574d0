// Package kubeclient is the Kubernetes client of the kubelet plugin: a
// kubernetes.Interface with only the API groups the plugin and the
// kubeletplugin helper call (core, resource.k8s.io and events.k8s.io).
//
// Why not kubernetes.NewForConfig: it builds a typed client for every API
// group, which links every group's client and apply configurations into the
// binary. The plugin's resident memory is mostly its binary's text
// (docs/benchmarks.md), so what is never called is better left out.
package kubeclient

import (
	"fmt"

	"k8s.io/client-go/discovery"
	"k8s.io/client-go/kubernetes"
	corev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	eventsv1 "k8s.io/client-go/kubernetes/typed/events/v1"
	resourcev1 "k8s.io/client-go/kubernetes/typed/resource/v1"
	resourcev1beta1 "k8s.io/client-go/kubernetes/typed/resource/v1beta1"
	resourcev1beta2 "k8s.io/client-go/kubernetes/typed/resource/v1beta2"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/flowcontrol"
)

// Clientset serves the core group, resource.k8s.io (v1 and the betas the
// kubeletplugin helper falls back to), events.k8s.io/v1 (the plugin's
// Events on its Node, through client-go's event recorder) and discovery.
// Any other group's method panics with a message that names this package:
// the embedded Interface is nil on purpose.
type Clientset struct {
	kubernetes.Interface
	core     corev1.CoreV1Interface
	resource resourcev1.ResourceV1Interface
	// The beta groups: the kubeletplugin helper's ResourceSlice client
	// builds a client of each version and falls back to an older one on a
	// server that lacks v1.
	resourceBeta1 resourcev1beta1.ResourceV1beta1Interface
	resourceBeta2 resourcev1beta2.ResourceV1beta2Interface
	events        eventsv1.EventsV1Interface
	discovery     *discovery.DiscoveryClient
}

var _ kubernetes.Interface = (*Clientset)(nil)

// NewForConfig builds the clients over one shared HTTP client (and rate
// limiter), as kubernetes.NewForConfig does.
func NewForConfig(c *rest.Config) (*Clientset, error) {
	cfg := rest.CopyConfig(c)
	if cfg.UserAgent == "" {
		cfg.UserAgent = rest.DefaultKubernetesUserAgent()
	}
	if cfg.RateLimiter == nil && cfg.QPS > 0 {
		burst := cfg.Burst
		if burst <= 0 {
			return nil, fmt.Errorf("burst is required to be greater than 0 when RateLimiter is not set and QPS is set to greater than 0")
		}
		// One token bucket for every group, as kubernetes.NewForConfig
		// installs: the plugin's QPS and burst are for all its requests.
		cfg.RateLimiter = flowcontrol.NewTokenBucketRateLimiter(cfg.QPS, burst)
	}
	httpClient, err := rest.HTTPClientFor(cfg)
	if err != nil {
		return nil, err
	}
	cs := &Clientset{}
	if cs.core, err = corev1.NewForConfigAndClient(cfg, httpClient); err != nil {
		return nil, err
	}
	if cs.resource, err = resourcev1.NewForConfigAndClient(cfg, httpClient); err != nil {
		return nil, err
	}
	if cs.resourceBeta1, err = resourcev1beta1.NewForConfigAndClient(cfg, httpClient); err != nil {
		return nil, err
	}
	if cs.resourceBeta2, err = resourcev1beta2.NewForConfigAndClient(cfg, httpClient); err != nil {
		return nil, err
	}
	if cs.events, err = eventsv1.NewForConfigAndClient(cfg, httpClient); err != nil {
		return nil, err
	}
	if cs.discovery, err = discovery.NewDiscoveryClientForConfigAndClient(cfg, httpClient); err != nil {
		return nil, err
	}
	return cs, nil
}

func (c *Clientset) CoreV1() corev1.CoreV1Interface             { return c.core }
func (c *Clientset) ResourceV1() resourcev1.ResourceV1Interface { return c.resource }
func (c *Clientset) ResourceV1beta1() resourcev1beta1.ResourceV1beta1Interface {
	return c.resourceBeta1
}
func (c *Clientset) ResourceV1beta2() resourcev1beta2.ResourceV1beta2Interface {
	return c.resourceBeta2
}
func (c *Clientset) EventsV1() eventsv1.EventsV1Interface     { return c.events }
func (c *Clientset) Discovery() discovery.DiscoveryInterfaces { return c.discovery }
