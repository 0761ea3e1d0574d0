// Package podnetwork is devcluster's pod network: the addresses of the pods
// devcluster serves in its own process (the simulated nodes' metrics pods,
// image mode's webhook endpoints) live in a network namespace devcluster
// makes, never on the machine's own interfaces, where they would be open to
// whatever network the machine is on. kube-apiserver reaches them, and the
// real nodes' pods in containerd's namespaces, through its egress selector:
// its "cluster" traffic (pod, service and node proxies, webhooks, the
// kubelets) goes through an HTTP CONNECT proxy on a unix socket, as a
// cluster's API server reaches a pod network it is not on through
// Konnectivity. The proxy dials each address in the namespace that holds it,
// and any other from the machine's own.
//
// What is real: kube-apiserver's egress selector and its HTTP CONNECT
// client, the kernel's network namespaces. What is devcluster's: the proxy
// (a few lines where Konnectivity's server and agents would run).
package podnetwork

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"

	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/devcluster/noderuntime"
)

// Address is the pods' address in devcluster's namespace: private, so
// that kube-apiserver agrees to proxy to it (it refuses loopback and
// link-local pod IPs), and on no interface of the machine.
const (
	Address = "10.250.0.1"
	cidr    = "10.250.0.0/16"
)

// Network is the running pod network.
type Network struct {
	netns  string
	nsFile *os.File
	holder *exec.Cmd
	done   chan struct{}
	proxy  net.Listener
	config string
	cancel context.CancelFunc

	mu     sync.Mutex
	routes []route
}

// route sends the addresses of a subnet to the network namespace that
// holds them (a real node's containerd).
type route struct {
	subnet *net.IPNet
	netns  string
}

// ErrUnavailable says this machine cannot have the pod network: not root,
// or no nsenter or ip (util-linux, iproute2).
var ErrUnavailable = errors.New("no pod network on this machine")

// Start makes the namespace (held by a process of its own, with Address on
// its loopback), the proxy's socket and kube-apiserver's egress selector
// configuration under dir. It needs root, nsenter and ip (ErrUnavailable).
func Start(ctx context.Context, dir string) (n *Network, err error) {
	if os.Geteuid() != 0 {
		return nil, fmt.Errorf("%w: a network namespace needs root", ErrUnavailable)
	}
	for _, tool := range []string{"sleep", "nsenter", "ip"} {
		if _, err := exec.LookPath(tool); err != nil {
			return nil, fmt.Errorf("%w: %s is missing (Debian's util-linux and iproute2; make real-node installs them)", ErrUnavailable, tool)
		}
	}
	// A process holds the namespace: sleep, which every machine has. No
	// Pdeathsig: it fires when the starting thread ends, and Go ends
	// threads (one locked to a goroutine that entered a namespace), which
	// killed the holder in the middle of a test run; Stop kills it.
	holder := exec.Command("sleep", "infinity")
	holder.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET, Setpgid: true}
	if err := holder.Start(); err != nil {
		return nil, fmt.Errorf("pod network: start its namespace's holder: %w", err)
	}
	n = &Network{holder: holder, done: make(chan struct{})}
	go func() { _ = holder.Wait(); close(n.done) }()
	defer func() {
		if err != nil {
			n.Stop()
		}
	}()
	// The namespace is held open by this process too, and entered through
	// that descriptor: it outlives its holder, should the holder die.
	holderNS := noderuntime.NetnsOf(holder.Process.Pid)
	if n.nsFile, err = os.Open(holderNS); err != nil {
		return n, fmt.Errorf("pod network: %w", err)
	}
	n.netns = fmt.Sprintf("/proc/%d/fd/%d", os.Getpid(), n.nsFile.Fd())
	for _, args := range [][]string{{"ip", "link", "set", "lo", "up"}, {"ip", "addr", "add", Address + "/32", "dev", "lo"}} {
		if out, err := exec.CommandContext(ctx, "nsenter", append([]string{"--net=" + holderNS, "--"}, args...)...).CombinedOutput(); err != nil {
			return n, fmt.Errorf("pod network: %v: %w: %s", args, err, out)
		}
	}
	_, own, _ := net.ParseCIDR(cidr)
	n.routes = []route{{subnet: own, netns: n.netns}}
	socket := filepath.Join(dir, "egress.sock")
	if n.proxy, err = net.Listen("unix", socket); err != nil {
		return n, fmt.Errorf("pod network: the API server's egress proxy: %w", err)
	}
	n.config = filepath.Join(dir, "egress-selector.yaml")
	cfg := fmt.Sprintf(`apiVersion: apiserver.k8s.io/v1beta1
kind: EgressSelectorConfiguration
egressSelections:
- name: cluster
  connection:
    proxyProtocol: HTTPConnect
    transport:
      uds:
        udsName: %s
`, socket)
	if err := os.WriteFile(n.config, []byte(cfg), 0o600); err != nil {
		return n, err
	}
	pctx, cancel := context.WithCancel(ctx)
	n.cancel = cancel
	go n.serve(pctx)
	return n, nil
}

// APIServerFlags point kube-apiserver's cluster egress at the proxy.
func (n *Network) APIServerFlags() []string {
	return []string{"--egress-selector-config-file=" + n.config}
}

// Listen listens on a free port of Address, inside the namespace.
func (n *Network) Listen() (net.Listener, error) {
	return noderuntime.ListenInNetns(n.netns, net.JoinHostPort(Address, "0"))
}

// AddRoute sends the addresses of subnet (CIDR) to the network namespace
// at netns (a /proc/<pid>/ns/net path).
func (n *Network) AddRoute(subnet, netns string) error {
	_, ipn, err := net.ParseCIDR(subnet)
	if err != nil {
		return err
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	n.routes = append(n.routes, route{subnet: ipn, netns: netns})
	return nil
}

// Dial connects to addr from the namespace that holds it, or from the
// machine's own.
func (n *Network) Dial(ctx context.Context, addr string) (net.Conn, error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, err
	}
	if ip := net.ParseIP(host); ip != nil {
		n.mu.Lock()
		routes := n.routes
		n.mu.Unlock()
		for _, r := range routes {
			if r.subnet.Contains(ip) {
				return noderuntime.DialInNetns(ctx, r.netns, addr)
			}
		}
	}
	var d net.Dialer
	return d.DialContext(ctx, "tcp", addr)
}

// serve answers the API server's CONNECT requests until ctx ends.
func (n *Network) serve(ctx context.Context) {
	go func() {
		<-ctx.Done()
		_ = n.proxy.Close()
	}()
	for {
		c, err := n.proxy.Accept()
		if err != nil {
			return
		}
		go n.tunnel(ctx, c)
	}
}

// tunnel reads one CONNECT request, dials its target and copies both ways.
func (n *Network) tunnel(ctx context.Context, c net.Conn) {
	defer c.Close()
	br := bufio.NewReader(c)
	req, err := http.ReadRequest(br)
	if err != nil {
		return
	}
	if req.Method != http.MethodConnect {
		_, _ = io.WriteString(c, "HTTP/1.1 405 Method Not Allowed\r\n\r\n")
		return
	}
	target := req.RequestURI
	if req.URL != nil && req.URL.Host != "" {
		target = req.URL.Host
	}
	up, err := n.Dial(ctx, target)
	if err != nil {
		klog.FromContext(ctx).V(2).Info("Pod network: the API server's connection could not be made", "target", target, "err", err)
		_, _ = fmt.Fprintf(c, "HTTP/1.1 502 Bad Gateway\r\n\r\n")
		return
	}
	defer up.Close()
	if _, err := io.WriteString(c, "HTTP/1.1 200 Connection established\r\n\r\n"); err != nil {
		return
	}
	done := make(chan struct{}, 2)
	go func() { _, _ = io.Copy(up, br); noderuntime.CloseWrite(up); done <- struct{}{} }()
	go func() { _, _ = io.Copy(c, up); noderuntime.CloseWrite(c); done <- struct{}{} }()
	<-done
	<-done
}

// Stop ends the proxy and the namespace's holder.
func (n *Network) Stop() {
	if n.cancel != nil {
		n.cancel()
	}
	if n.proxy != nil {
		_ = n.proxy.Close()
	}
	if n.holder != nil && n.holder.Process != nil {
		_ = n.holder.Process.Kill()
		<-n.done
	}
	if n.nsFile != nil {
		_ = n.nsFile.Close()
	}
}
