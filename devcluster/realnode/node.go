package realnode

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
	v1 "k8s.io/api/core/v1"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/devcluster/noderuntime"
)

// Binaries are the real node's programs (make real-node builds them into
// bin/real-node).
type Binaries struct {
	Kubelet, Containerd, Shim, Ctr string
	// Runc is a runc built with libseccomp (the CRI plugin asks for
	// seccomp profiles).
	Runc string
	// CNI is the directory of the CNI plugins: bridge, host-local,
	// loopback.
	CNI string
	// Pause and Probe are the static binaries of the pause and the probe
	// images.
	Pause, Probe string
	// MPSControl is a static nvidia-cuda-mps-control stand-in
	// (devcluster/cmd/fake-mps-control), installed in a simulated
	// driver root: the plugin's and the MPS server pods' containers run
	// it, and they have no shell for hack/'s script. Empty: no MPS.
	MPSControl string
}

// Options describe a real node.
type Options struct {
	Name string
	// Dir is the node's directory: containerd's root and state, the
	// kubelet's root, pod logs, CNI state. Keep it short: containerd's and
	// the kubelet's unix sockets live below it.
	Dir      string
	Binaries Binaries
	// APIServer is the API server's URL; CA its serving CA (PEM); Cert and
	// Key the node's client credential (PEM), for system:node:<Name>.
	APIServer    string
	CA           []byte
	Cert, Key    []byte
	CDIDirs      []string
	PodSubnet    string
	StartTimeout time.Duration
	// Labels are the kubelet's --node-labels (what NodeRestriction lets
	// a kubelet set; not below kubernetes.io or k8s.io).
	Labels map[string]string
	// Taints are the kubelet's --register-with-taints.
	Taints []v1.Taint
	// KubeletRootDir is the kubelet's --root-dir; empty: Dir/kubelet.
	// devcluster gives it the node's directory, which the chart is
	// rendered with as kubeletPlugin.kubeletDir.
	KubeletRootDir string
	// Images are more docker tarballs to import, each tagged Ref (make
	// image's, as the chart names it).
	Images []Tarball
	// APIServerVIP is the kubernetes Service's address (host:port), which
	// the kubelet gives pods as KUBERNETES_SERVICE_HOST and _PORT: with
	// no kube-proxy, devcluster serves it inside containerd's network
	// namespace and forwards each connection to the API server, as
	// kube-proxy's rule does. Empty: pods do not reach the API server.
	APIServerVIP string
}

// Tarball is an image tarball and the reference it is tagged with.
type Tarball struct{ File, Ref string }

// KubeletDevicePluginDir is where every kubelet serves its device manager
// (kubelet.sock) and dials device plugins, whatever its --root-dir.
const KubeletDevicePluginDir = "/var/lib/kubelet/device-plugins"

const kubeletDevicePluginSocket = KubeletDevicePluginDir + "/kubelet.sock"

// Node is a running real node.
type Node struct {
	Name string
	Dir  string
	opts Options
	// containerd and kubelet are the processes; containerdDone and
	// kubeletDone are closed when each has exited.
	containerd, kubelet         *exec.Cmd
	containerdDone, kubeletDone chan struct{}
	// stopVIP ends the API server's forwarder (APIServerVIP).
	stopVIP context.CancelFunc
	// stopKubeletPort ends the forwarder of the kubelet's port from the
	// host's loopback into containerd's namespace.
	stopKubeletPort context.CancelFunc
	// hostDirs are the machine's directories the kubelet writes to, as
	// they were before it started (kubeletHostDirs).
	hostDirs []hostDirSnapshot
}

// ContainerdSocket is containerd's gRPC socket (the kubelet's CRI
// endpoint).
func (n *Node) ContainerdSocket() string {
	return filepath.Join(n.Dir, "containerd", "containerd.sock")
}

// KubeletRootDir is the kubelet's --root-dir.
func (n *Node) KubeletRootDir() string {
	if n.opts.KubeletRootDir != "" {
		return n.opts.KubeletRootDir
	}
	return filepath.Join(n.Dir, "kubelet")
}

// Start writes the configurations, starts containerd in a network
// namespace of its own, imports the pause and probe images, and starts the
// kubelet, which registers the Node. It does not wait for the Node to be
// Ready (the caller watches the API).
func Start(ctx context.Context, opts Options) (n *Node, err error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("a real node runs containerd and the kubelet, which need root")
	}
	// Its cleanup unmounts below these: never "" or a relative path.
	if opts.Name == "" || !filepath.IsAbs(opts.Dir) || (opts.KubeletRootDir != "" && !filepath.IsAbs(opts.KubeletRootDir)) {
		return nil, fmt.Errorf("real node %q: Name, and an absolute Dir (%q) and KubeletRootDir (%q), are required", opts.Name, opts.Dir, opts.KubeletRootDir)
	}
	// The kubelet's device manager serves, and at start empties,
	// /var/lib/kubelet/device-plugins whatever its root directory: on a
	// machine whose own kubelet serves there, it would take its sockets.
	if c, err := net.Dial("unix", kubeletDevicePluginSocket); err == nil {
		_ = c.Close()
		return nil, fmt.Errorf("real node %s: a kubelet already serves %s on this machine (a Kubernetes node, or another real node): devcluster runs one real node per machine, and never on a node", opts.Name, kubeletDevicePluginSocket)
	}
	for what, p := range map[string]string{"kubelet": opts.Binaries.Kubelet, "containerd": opts.Binaries.Containerd,
		"containerd-shim-runc-v2": opts.Binaries.Shim, "ctr": opts.Binaries.Ctr, "runc": opts.Binaries.Runc,
		"the CNI plugins' directory": opts.Binaries.CNI, "pause": opts.Binaries.Pause, "gpudra-probe": opts.Binaries.Probe} {
		if _, err := os.Stat(p); err != nil {
			return nil, fmt.Errorf("real node %s: %s: %w (make real-node builds them)", opts.Name, what, err)
		}
	}
	n = &Node{Name: opts.Name, Dir: opts.Dir, opts: opts}
	for _, d := range kubeletHostDirs {
		n.hostDirs = append(n.hostDirs, snapshotHostDir(d))
	}
	for _, d := range []string{filepath.Join(n.Dir, "containerd"), filepath.Join(n.Dir, "cni"), filepath.Join(n.Dir, "cni-ipam"),
		n.PodLogDir(), n.KubeletRootDir(), filepath.Join(n.Dir, "images")} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return nil, err
		}
	}
	defer func() {
		if err != nil {
			n.Stop()
		}
	}()
	if err := n.startContainerd(ctx); err != nil {
		return n, err
	}
	for _, img := range []Image{
		{Ref: PauseImage, Files: map[string]string{"/pause": opts.Binaries.Pause}, Entrypoint: []string{"/pause"}},
		{Ref: ProbeImage, Files: map[string]string{"/gpudra-probe": opts.Binaries.Probe}, Entrypoint: []string{"/gpudra-probe"}},
	} {
		file := filepath.Join(n.Dir, "images", strings.NewReplacer("/", "_", ":", "_").Replace(img.Ref)+".tar")
		if err := writeTarball(img, file); err != nil {
			return n, err
		}
		if err := importImage(ctx, opts.Binaries.Ctr, n.ContainerdSocket(), file, ""); err != nil {
			return n, err
		}
	}
	for _, t := range opts.Images {
		if err := importImage(ctx, opts.Binaries.Ctr, n.ContainerdSocket(), t.File, t.Ref); err != nil {
			return n, err
		}
	}
	if opts.APIServerVIP != "" {
		if err := n.serveAPIServerVIP(); err != nil {
			return n, err
		}
	}
	if err := n.startKubelet(ctx); err != nil {
		return n, err
	}
	return n, nil
}

// startContainerd starts containerd in a new network namespace, so that
// the CNI bridge and the pods' addresses exist only there; its socket is a
// unix socket, which the kubelet reaches from the host's namespace.
func (n *Node) startContainerd(ctx context.Context) error {
	cfg := filepath.Join(n.Dir, "containerd.toml")
	if err := os.WriteFile(cfg, []byte(containerdConfig(n.Dir, n.opts.Binaries, n.opts.CDIDirs, PauseImage)), 0o600); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(n.Dir, "cni", "10-devcluster.conflist"), []byte(cniConfig(n.Dir, n.opts.PodSubnet)), 0o600); err != nil {
		return err
	}
	cmd := exec.Command(n.opts.Binaries.Containerd, "--config", cfg)
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNET, Setpgid: true}
	var err error
	if cmd.Stdout, err = os.Create(filepath.Join(n.Dir, "containerd.log")); err != nil {
		return err
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("real node %s: start containerd: %w", n.Name, err)
	}
	n.containerd, n.containerdDone = cmd, make(chan struct{})
	go func() { _ = cmd.Wait(); close(n.containerdDone) }()
	// The loopback of its namespace, up, as a node's is.
	if out, err := exec.CommandContext(ctx, "nsenter", "--net=/proc/"+strconv.Itoa(cmd.Process.Pid)+"/ns/net", "ip", "link", "set", "lo", "up").CombinedOutput(); err != nil {
		klog.FromContext(ctx).Info("containerd's network namespace keeps its loopback down", "node", n.Name, "err", err, "output", string(out))
	}
	return n.waitFor(ctx, "containerd's socket", n.containerdDone, filepath.Join(n.Dir, "containerd.log"), func() bool {
		c, err := net.Dial("unix", n.ContainerdSocket())
		if err != nil {
			return false
		}
		_ = c.Close()
		return true
	})
}

// startKubelet writes the kubelet's kubeconfig (the node credential) and
// configuration and starts it.
func (n *Node) startKubelet(ctx context.Context) error {
	// With the kubernetes Service's address served in containerd's
	// namespace, the kubelet runs there too, as a node's kubelet shares
	// its pods' network: its HTTP probes reach the pods' addresses, which
	// exist only there. It reaches the API server through that address.
	inNetns := n.opts.APIServerVIP != ""
	server := n.opts.APIServer
	if inNetns {
		server = "https://" + n.opts.APIServerVIP
	}
	kc := clientcmdapi.NewConfig()
	kc.Clusters["devcluster"] = &clientcmdapi.Cluster{Server: server, CertificateAuthorityData: n.opts.CA}
	kc.AuthInfos[n.Name] = &clientcmdapi.AuthInfo{ClientCertificateData: n.opts.Cert, ClientKeyData: n.opts.Key}
	kc.Contexts["devcluster"] = &clientcmdapi.Context{Cluster: "devcluster", AuthInfo: n.Name}
	kc.CurrentContext = "devcluster"
	kubeconfig := filepath.Join(n.Dir, "kubelet.kubeconfig")
	if err := clientcmd.WriteToFile(*kc, kubeconfig); err != nil {
		return err
	}
	port, err := freePort()
	if err != nil {
		return err
	}
	cfg := filepath.Join(n.Dir, "kubelet.yaml")
	if err := os.WriteFile(cfg, []byte(kubeletConfig(n.Dir, n.ContainerdSocket(), port)), 0o600); err != nil {
		return err
	}
	args := []string{"--config", cfg, "--kubeconfig", kubeconfig, "--root-dir", n.KubeletRootDir(),
		"--hostname-override", n.Name, "--node-ip", "127.0.0.1", "--cert-dir", filepath.Join(n.KubeletRootDir(), "pki"), "--v", "2"}
	if len(n.opts.Labels) > 0 {
		var labels []string
		for _, k := range slices.Sorted(maps.Keys(n.opts.Labels)) {
			labels = append(labels, k+"="+n.opts.Labels[k])
		}
		args = append(args, "--node-labels", strings.Join(labels, ","))
	}
	if len(n.opts.Taints) > 0 {
		var taints []string
		for _, t := range n.opts.Taints {
			taints = append(taints, t.Key+"="+t.Value+":"+string(t.Effect))
		}
		args = append(args, "--register-with-taints", strings.Join(taints, ","))
	}
	cmd := exec.Command(n.opts.Binaries.Kubelet, args...)
	netns := noderuntime.NetnsOf(n.containerd.Process.Pid)
	if inNetns {
		// nsenter execs the kubelet: the process is the kubelet's.
		cmd = exec.Command("nsenter", append([]string{"--net=" + netns, "--", n.opts.Binaries.Kubelet}, args...)...)
	}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	// Appended to: a restarted kubelet's log follows the last one's.
	log := filepath.Join(n.Dir, "kubelet.log")
	logFile, err := os.OpenFile(log, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o640)
	if err != nil {
		return err
	}
	cmd.Stdout = logFile
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		_ = logFile.Close()
		return fmt.Errorf("real node %s: start the kubelet: %w", n.Name, err)
	}
	n.kubelet, n.kubeletDone = cmd, make(chan struct{})
	go func() { _ = cmd.Wait(); _ = logFile.Close(); close(n.kubeletDone) }()
	if inNetns {
		// The API server reaches the kubelet (logs, exec) at the Node's
		// address, 127.0.0.1:port, on the host: forwarded into the
		// namespace, where the kubelet listens.
		if err := n.forwardKubeletPort(netns, port); err != nil {
			return err
		}
	}
	// Up once it has made its plugin registry (it has read its
	// configuration and reached the runtime by then).
	return n.waitFor(ctx, "the kubelet", n.kubeletDone, log, func() bool {
		_, err := os.Stat(filepath.Join(n.KubeletRootDir(), "plugins_registry"))
		return err == nil
	})
}

// forwardKubeletPort listens on the host's 127.0.0.1:port and forwards
// each connection to the same address in containerd's namespace.
func (n *Node) forwardKubeletPort(netns string, port int) error {
	addr := net.JoinHostPort("127.0.0.1", strconv.Itoa(port))
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("real node %s: forward the kubelet's port: %w", n.Name, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	n.stopKubeletPort = func() { cancel(); _ = l.Close() }
	go noderuntime.Forward(ctx, l, func(ctx context.Context) (net.Conn, error) {
		return noderuntime.DialInNetns(ctx, netns, addr)
	})
	return nil
}

// RestartKubelet kills the kubelet (SIGKILL: a crash, which gets no
// chance to tidy up) and starts it again with the same configuration, as
// systemd restarts a node's kubelet. Containers keep running in containerd
// meanwhile.
func (n *Node) RestartKubelet(ctx context.Context) error {
	if n.kubelet == nil || n.kubelet.Process == nil {
		return fmt.Errorf("real node %s: no kubelet runs", n.Name)
	}
	_ = n.kubelet.Process.Kill()
	<-n.kubeletDone
	if n.stopKubeletPort != nil {
		n.stopKubeletPort()
	}
	return n.startKubelet(ctx)
}

// waitFor polls ready until it holds, the process ends (its log's end is
// the error) or the start timeout passes.
func (n *Node) waitFor(ctx context.Context, what string, done <-chan struct{}, log string, ready func() bool) error {
	timeout := n.opts.StartTimeout
	if timeout == 0 {
		timeout = time.Minute
	}
	deadline := time.Now().Add(timeout)
	for !ready() {
		select {
		case <-done:
			return fmt.Errorf("real node %s: %s exited: %s", n.Name, what, tail(log, 5))
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("real node %s: %s not up within %s: %s", n.Name, what, timeout, tail(log, 5))
		}
	}
	return nil
}

// Stop stops the kubelet, the pods' containers and their shims, then
// containerd, and unmounts what they left mounted below the node's
// directory and the kubelet's (containers' roots, the sandboxes' network
// namespaces, the pods' volumes). The directories stay, for their logs.
func (n *Node) Stop() {
	if n.stopVIP != nil {
		n.stopVIP()
	}
	if n.stopKubeletPort != nil {
		n.stopKubeletPort()
	}
	stop(n.kubelet, n.kubeletDone)
	n.killShims()
	stop(n.containerd, n.containerdDone)
	// The kubelet makes its root directory a mount of its own and mounts
	// the pods' projected volumes below it.
	unmountBelow(n.Dir, n.KubeletRootDir())
	for _, d := range n.hostDirs {
		d.restore()
	}
}

// stop ends a process: SIGTERM, then SIGKILL after 10 s.
func stop(cmd *exec.Cmd, done <-chan struct{}) {
	if cmd == nil || cmd.Process == nil {
		return
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		_ = cmd.Process.Kill()
		<-done
	}
}

// killShims kills the node's containerd shims and everything in their
// process groups: a shim outlives containerd by design, and its containers
// with it.
func (n *Node) killShims() {
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(string(b), "\x00")
		if len(args) == 0 || filepath.Base(args[0]) != filepath.Base(n.opts.Binaries.Shim) || !slices.Contains(args, n.ContainerdSocket()) {
			continue
		}
		// The shim's containers are its children, in their own groups:
		// their runc state is under containerd's; kill the children first.
		for _, child := range children(pid) {
			_ = syscall.Kill(child, syscall.SIGKILL)
		}
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
}

// children are the processes whose parent is pid.
func children(pid int) []int {
	var out []int
	entries, _ := os.ReadDir("/proc")
	for _, e := range entries {
		p, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", e.Name(), "stat"))
		if err != nil {
			continue
		}
		// pid (comm) state ppid ...: comm may hold spaces, so read after ')'.
		s := string(b)
		i := strings.LastIndexByte(s, ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(s[i+1:])
		if len(f) > 1 && f[1] == strconv.Itoa(pid) {
			out = append(out, p)
		}
	}
	return out
}

// unmountBelow unmounts every mount point at or below the directories,
// deepest first.
func unmountBelow(dirs ...string) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return
	}
	defer f.Close()
	var points []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) <= 4 {
			continue
		}
		for _, dir := range dirs {
			if !filepath.IsAbs(dir) || dir == "/" {
				continue
			}
			if fields[4] == dir || strings.HasPrefix(fields[4], dir+"/") {
				points = append(points, fields[4])
				break
			}
		}
	}
	sort.Slice(points, func(i, j int) bool { return len(points[i]) > len(points[j]) })
	for _, p := range points {
		_ = unix.Unmount(p, unix.MNT_DETACH)
	}
}

func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// serveAPIServerVIP puts the kubernetes Service's address on the loopback
// of containerd's network namespace, where the pods' default route (the
// bridge) leads, and forwards what connects there to the API server.
func (n *Node) serveAPIServerVIP() error {
	host, _, err := net.SplitHostPort(n.opts.APIServerVIP)
	if err != nil {
		return fmt.Errorf("real node %s: APIServerVIP: %w", n.Name, err)
	}
	netns := noderuntime.NetnsOf(n.containerd.Process.Pid)
	if out, err := exec.Command("nsenter", "--net="+netns, "ip", "addr", "add", host+"/32", "dev", "lo").CombinedOutput(); err != nil {
		return fmt.Errorf("real node %s: the kubernetes Service's address in containerd's namespace: %w: %s", n.Name, err, out)
	}
	l, err := noderuntime.ListenInNetns(netns, n.opts.APIServerVIP)
	if err != nil {
		return fmt.Errorf("real node %s: listen on the kubernetes Service's address: %w", n.Name, err)
	}
	u, err := url.Parse(n.opts.APIServer)
	if err != nil {
		_ = l.Close()
		return err
	}
	ctx, cancel := context.WithCancel(context.Background())
	n.stopVIP = func() { cancel(); _ = l.Close() }
	go noderuntime.Forward(ctx, l, func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", u.Host)
	})
	return nil
}
