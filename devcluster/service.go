package devcluster

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"

	v1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/klog/v2"
	"k8s.io/utils/ptr"

	"github.com/gpudra/gpudra/devcluster/nodeagent"
)

// ServiceRoute is a Service routed to a process on this machine
// (ServeService).
type ServiceRoute struct {
	// Addr is the endpoint's address on the pod network.
	Addr     net.Addr
	listener net.Listener
	wg       sync.WaitGroup
}

// ServeService routes the Service namespace/name's port (the Service
// must exist) to backend, an address a process of this machine listens on
// (an engine's webhook server on 127.0.0.1): a front on devcluster's pod
// network forwards each connection to it, and an EndpointSlice names the
// front as the Service's one ready endpoint, as the EndpointSlice
// controller would for a ready pod. kube-apiserver reaches a webhook or a
// conversion webhook named by the Service through it (it routes Services
// to their endpoints, --enable-aggregator-routing, as no kube-proxy runs
// here). The bytes pass through unchanged: TLS is between the API server
// and the backend, with the backend's certificate for the Service's name.
func (c *Cluster) ServeService(ctx context.Context, namespace, name string, port int32, backend string) (*ServiceRoute, error) {
	svc, err := c.Client.CoreV1().Services(namespace).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		return nil, fmt.Errorf("Service %s/%s: %w", namespace, name, err)
	}
	var svcPort *v1.ServicePort
	for i := range svc.Spec.Ports {
		if svc.Spec.Ports[i].Port == port {
			svcPort = &svc.Spec.Ports[i]
		}
	}
	if svcPort == nil {
		return nil, fmt.Errorf("Service %s/%s has no port %d", namespace, name, port)
	}
	l, err := nodeagent.ListenForPod(c.podNetwork())
	if err != nil {
		return nil, fmt.Errorf("Service %s/%s: an endpoint the API server dials: %w", namespace, name, err)
	}
	r := &ServiceRoute{Addr: l.Addr(), listener: l}
	r.wg.Add(1)
	go r.forward(klog.FromContext(ctx).WithValues("service", namespace+"/"+name), backend)
	tcp := l.Addr().(*net.TCPAddr)
	slice := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Name: name + "-devcluster", Namespace: namespace,
			Labels: map[string]string{discoveryv1.LabelServiceName: name, discoveryv1.LabelManagedBy: "devcluster.gpudra.dev"}},
		AddressType: discoveryv1.AddressTypeIPv4,
		Endpoints:   []discoveryv1.Endpoint{{Addresses: []string{tcp.IP.String()}, Conditions: discoveryv1.EndpointConditions{Ready: ptr.To(true)}}},
		Ports: []discoveryv1.EndpointPort{{Name: ptr.To(svcPort.Name), Port: ptr.To(int32(tcp.Port)), //nolint:gosec // a port
			Protocol: ptr.To(v1.ProtocolTCP)}},
	}
	if _, err := c.Client.DiscoveryV1().EndpointSlices(namespace).Create(ctx, slice, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		r.Close()
		return nil, fmt.Errorf("Service %s/%s's EndpointSlice: %w", namespace, name, err)
	}
	return r, nil
}

func (r *ServiceRoute) forward(logger klog.Logger, backend string) {
	defer r.wg.Done()
	for {
		conn, err := r.listener.Accept()
		if err != nil {
			if !errors.Is(err, net.ErrClosed) {
				logger.Error(err, "Service front stopped")
			}
			return
		}
		go func() {
			defer conn.Close()
			up, err := net.Dial("tcp", backend)
			if err != nil {
				logger.V(2).Info("Service backend not reachable", "backend", backend, "err", err)
				return
			}
			defer up.Close()
			done := make(chan struct{})
			go func() {
				_, _ = io.Copy(up, conn)
				if tc, ok := up.(*net.TCPConn); ok {
					_ = tc.CloseWrite()
				}
				close(done)
			}()
			_, _ = io.Copy(conn, up)
			// The backend is done: so is the client's side.
			_ = conn.Close()
			<-done
		}()
	}
}

// Close stops the front; the EndpointSlice stays until the cluster stops.
func (r *ServiceRoute) Close() {
	_ = r.listener.Close()
	r.wg.Wait()
}
