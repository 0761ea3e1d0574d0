package imagemode

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/intstr"

	"github.com/gpudra/gpudra/devcluster/noderuntime"
)

// A pod run from the image: its readiness and liveness probes, dialled
// from inside its network namespace.

func probePeriod(pr *v1.Probe) time.Duration {
	if pr.PeriodSeconds <= 0 {
		return 10 * time.Second
	}
	return time.Duration(pr.PeriodSeconds) * time.Second
}

// probe runs an httpGet or tcpSocket probe against the container, from
// inside its network namespace (its pod IP, were there a pod network).
func (p *Pod) probe(ctx context.Context, pr *v1.Probe) error {
	c := &p.pod.Spec.Containers[0]
	p.mu.Lock()
	netns := noderuntime.NetnsOf(p.pid)
	p.mu.Unlock()
	dial := func(ctx context.Context, addr string) (net.Conn, error) {
		return noderuntime.DialInNetns(ctx, netns, addr)
	}
	if p.pod.Spec.HostNetwork {
		// The host's network, which this process is in; no thread of it
		// is entered (one may be parked in a pod's namespace).
		dial = func(ctx context.Context, addr string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "tcp", addr)
		}
	}
	timeout := time.Duration(max(pr.TimeoutSeconds, 1)) * time.Second
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	switch {
	case pr.HTTPGet != nil:
		port, err := ContainerPort(c, pr.HTTPGet.Port)
		if err != nil {
			return err
		}
		addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
		// As the kubelet's prober: HTTPS without verifying the
		// certificate.
		tr := &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) { return dial(ctx, addr) },
			TLSClientConfig: &tls.Config{InsecureSkipVerify: true}} //nolint:gosec // as the kubelet probes
		defer tr.CloseIdleConnections()
		scheme := strings.ToLower(string(pr.HTTPGet.Scheme))
		if scheme == "" {
			scheme = "http"
		}
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, scheme+"://"+addr+pr.HTTPGet.Path, nil)
		if err != nil {
			return err
		}
		resp, err := (&http.Client{Transport: tr, Timeout: timeout}).Do(req)
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode < 200 || resp.StatusCode >= 400 {
			return fmt.Errorf("GET %s: %s", pr.HTTPGet.Path, resp.Status)
		}
		return nil
	case pr.TCPSocket != nil:
		port, err := ContainerPort(c, pr.TCPSocket.Port)
		if err != nil {
			return err
		}
		conn, err := dial(ctx, net.JoinHostPort("127.0.0.1", strconv.Itoa(port)))
		if err != nil {
			return err
		}
		return conn.Close()
	}
	return errors.New("probe: only httpGet and tcpSocket probes are run by devcluster")
}

// ContainerPort resolves a probe's port: a number, or a container port's
// name.
func ContainerPort(c *v1.Container, port intstr.IntOrString) (int, error) {
	if port.Type == intstr.Int {
		return port.IntValue(), nil
	}
	for _, p := range c.Ports {
		if p.Name == port.StrVal {
			return int(p.ContainerPort), nil
		}
	}
	return 0, fmt.Errorf("container %s has no port named %q", c.Name, port.StrVal)
}
