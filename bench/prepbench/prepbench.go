// Package prepbench measures the kubelet plugin's prepare and unprepare
// latency and its memory as a node sees them: the plugin binary runs as a
// process of its own against devcluster's real API server (with its real
// request handling and the plugin's shipped client rate limits), the claims
// are real allocated ResourceClaims in that server, and the benchmark plays
// the kubelet over the plugin's DRA socket, one claim after the other.
package prepbench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	v1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/klog/v2"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/chart"
)

// Config of one run.
type Config struct {
	// PluginBinary is gpudra-kubelet-plugin, built as shipped, or with
	// Foreign set another driver's kubelet plugin.
	PluginBinary string
	// Claims is how many 1-GPU claims are prepared and unprepared, one
	// after the other.
	Claims int
	// Machine is the simulated machine (--sim-machine) of Backend "sim".
	Machine string
	// DeviceFormat names a claim's device from its index modulo Devices
	// (fmt verb %d); empty: "gpu-%d", a whole GPU.
	DeviceFormat string
	Devices      int
	// DevicesOverride, when not empty, are the claims' devices by name,
	// round robin (claim i gets DevicesOverride[i%len]), instead of
	// DeviceFormat over Devices: the whole GPUs of a real node, say.
	DevicesOverride []string
	// Backend is the gpudra plugin's GPU backend: "" or "sim" (the
	// simulated Machine, --backend=sim), or "nvml" (the node's real GPUs,
	// --backend=nvml --driver-root=DriverRoot). Not for Foreign.
	Backend string
	// DriverRoot is where the NVIDIA driver is installed, for Backend
	// "nvml"; empty: "/".
	DriverRoot string
	// ClientQPS and ClientBurst are the plugin's API client limits
	// (--kube-api-qps, --kube-api-burst, which gpudra's and the DRA
	// example driver's plugins both have); zero: the plugin's default.
	ClientQPS   float64
	ClientBurst int
	// PluginArgs are added to the plugin's flags (for example
	// --kube-api-qps to compare client settings).
	PluginArgs []string
	// PluginEnv is added to the plugin's environment (NAME=value: for
	// example GODEBUG=gctrace=1).
	PluginEnv []string
	// Foreign, when set, runs another DRA driver's kubelet plugin
	// (PluginBinary) in the same harness: same API server, same client
	// limits, same claims round robin over the same devices, under its
	// driver name and with its own flags (ExampleDriver).
	Foreign *Foreign
	// Dir is where the cluster and the plugin keep their files; empty: a
	// temporary directory.
	Dir string
	// Chart gives the cluster its identities; the plugin runs as the
	// chart's ServiceAccount.
	Chart chart.Options
	// Cluster, when set, is the control plane to run against (Chart is
	// then not used, and Run does not stop it); nil: Run starts one and
	// stops it at the end.
	Cluster *devcluster.Cluster
	// Node is the Node, and the plugin's pool; empty: "bench-node". With
	// a shared Cluster give each run a node of its own.
	Node string
	// Paced makes the benchmark's own requests (creating the claims, the
	// claim read before each prepare) through the cluster's admin client
	// and its rate limiter (100 QPS, burst 200), as before issue 34: the
	// creation spends the burst and each read then waits for a token, which
	// paces the loop at about 100 prepares a second. False: a client
	// without a limit, prepares back to back.
	Paced bool
}

// Foreign is a DRA driver's kubelet plugin that is not gpudra's. Its Args
// and Env may name the run's paths: {node}, {kubeconfig}, {pluginsDir}
// (the kubelet's plugins directory: the plugin's own is a directory in
// it), {registrarDir}, {cdiDir} and {devices} (Devices) are replaced.
type Foreign struct {
	// Name is what the plugin is called in logs and reports.
	Name string
	// Driver is its DRA driver name: the claims' device class and results
	// name it, and its slices carry it.
	Driver string
	// Args are its flags, Env its environment (NAME=value).
	Args, Env []string
	// Socket is its DRA socket (placeholders expanded).
	Socket string
	// Rules are what its ServiceAccount may do: its chart's ClusterRole.
	// It runs as a ServiceAccount of its own (ForeignServiceAccount), its
	// token bound to the Node like gpudra's.
	Rules []rbacv1.PolicyRule
}

// ForeignServiceAccount runs a Foreign plugin (gpudra's chart policies
// allow gpudra's ServiceAccount to publish only gpudra's slices).
const ForeignServiceAccount = "prepbench-foreign-plugin"

// ExampleDriver is the DRA example driver's kubelet plugin
// (kubernetes-sigs/dra-example-driver, cmd/dra-example-kubeletplugin) with
// its gpu profile: devices gpu-0 ... gpu-<devices-1> of driver
// gpu.example.com, flags as its chart sets them by environment, no
// metrics or health endpoint (gpudra's plugin runs without metrics too),
// RBAC as its chart's ClusterRole.
func ExampleDriver() *Foreign {
	const driver = "gpu.example.com"
	return &Foreign{
		Name:   "dra-example-driver",
		Driver: driver,
		Args: []string{"--node-name={node}", "--kubeconfig={kubeconfig}", "--device-profile=gpu", "--driver-name=" + driver,
			"--num-devices={devices}", "--kubelet-plugins-directory-path={pluginsDir}", "--kubelet-registrar-directory-path={registrarDir}",
			"--cdi-root={cdiDir}", "--healthcheck-port=-1", "--metrics-port=-1"},
		Socket: "{pluginsDir}/" + driver + "/dra.sock",
		Rules: []rbacv1.PolicyRule{
			{APIGroups: []string{"resource.k8s.io"}, Resources: []string{"resourceclaims"}, Verbs: []string{"get", "list", "watch"}},
			{APIGroups: []string{"resource.k8s.io"}, Resources: []string{"resourceclaims/status"}, Verbs: []string{"update"}},
			{APIGroups: []string{"resource.k8s.io"}, Resources: []string{"resourceclaims/driver"}, Verbs: []string{"associated-node:update", "associated-node:patch"}, ResourceNames: []string{driver}},
			{APIGroups: []string{""}, Resources: []string{"nodes"}, Verbs: []string{"get"}},
			{APIGroups: []string{"resource.k8s.io"}, Resources: []string{"resourceslices"}, Verbs: []string{"get", "list", "watch", "create", "update", "patch", "delete"}},
		},
	}
}

func (c Config) deviceFormat() string {
	if c.DeviceFormat == "" {
		return "gpu-%d"
	}
	return c.DeviceFormat
}

func (c Config) node() string {
	if c.Node == "" {
		return defaultNode
	}
	return c.Node
}

// driver is the DRA driver the claims name.
func (c Config) driver() string {
	if c.Foreign != nil {
		return c.Foreign.Driver
	}
	return gpudraDriver
}

// name is the plugin's name in reports.
func (c Config) name() string {
	if c.Foreign != nil {
		return c.Foreign.Name
	}
	return "gpudra"
}

// device is claim i's device.
func (c Config) device(i int) string {
	if len(c.DevicesOverride) > 0 {
		return c.DevicesOverride[i%len(c.DevicesOverride)]
	}
	return fmt.Sprintf(c.deviceFormat(), i%c.Devices)
}

func (c Config) validate() error {
	if c.Claims <= 0 || (c.Devices <= 0 && len(c.DevicesOverride) == 0) {
		return errors.New("Claims and Devices (or DevicesOverride) must be positive")
	}
	switch c.Backend {
	case "", "sim", "nvml":
	default:
		return fmt.Errorf("Backend %q: want sim or nvml", c.Backend)
	}
	if c.Foreign != nil && c.Backend != "" {
		return errors.New("Backend is gpudra's plugin's flag; a Foreign plugin brings its own devices")
	}
	if c.Foreign != nil && (c.Foreign.Driver == "" || c.Foreign.Socket == "") {
		return errors.New("a Foreign plugin needs its Driver and Socket")
	}
	return nil
}

// Paths are where a run's plugin keeps its files.
type Paths struct {
	Node, Kubeconfig, PluginsDir, RegistrarDir, CDIDir string
	Devices                                            int
}

func (p Paths) expand(s string) string {
	return strings.NewReplacer("{node}", p.Node, "{kubeconfig}", p.Kubeconfig, "{pluginsDir}", p.PluginsDir,
		"{registrarDir}", p.RegistrarDir, "{cdiDir}", p.CDIDir, "{devices}", strconv.Itoa(p.Devices)).Replace(s)
}

// Command is the plugin's flags, its extra environment and its DRA socket
// for a run with these paths.
func (c Config) Command(p Paths) (args, env []string, socket string) {
	if f := c.Foreign; f != nil {
		for _, a := range f.Args {
			args = append(args, p.expand(a))
		}
		for _, e := range f.Env {
			env = append(env, p.expand(e))
		}
		socket = p.expand(f.Socket)
	} else {
		// gpudra's plugin data directory is its own (the chart mounts
		// <kubelet>/plugins/gpu.gpudra.dev there).
		pluginDir := filepath.Join(p.PluginsDir, gpudraDriver)
		args = []string{"--node-name=" + p.Node, "--kubeconfig=" + p.Kubeconfig}
		if c.Backend == "nvml" {
			root := c.DriverRoot
			if root == "" {
				root = "/"
			}
			args = append(args, "--backend=nvml", "--driver-root="+root)
		} else {
			args = append(args, "--backend=sim", "--sim-machine="+c.Machine)
		}
		// The bench plays the node's kubelet: what the plugin reads of a
		// kubelet's state is the bench's too, never the machine's own
		// (a real node's device manager may have left a checkpoint in
		// /var/lib/kubelet, which DRA mode would refuse to start over).
		root := filepath.Dir(p.PluginsDir)
		args = append(args, "--plugin-data-dir="+pluginDir, "--registrar-dir="+p.RegistrarDir, "--cdi-dir="+p.CDIDir, "--metrics-address=", "-v=0",
			"--kubelet-device-checkpoint="+filepath.Join(root, "device-plugins", "kubelet_internal_checkpoint"),
			"--pod-resources-socket="+filepath.Join(root, "pod-resources", "kubelet.sock"))
		socket = filepath.Join(pluginDir, "dra.sock")
	}
	if c.ClientQPS > 0 {
		args = append(args, "--kube-api-qps="+strconv.FormatFloat(c.ClientQPS, 'f', -1, 64))
	}
	if c.ClientBurst > 0 {
		args = append(args, "--kube-api-burst="+strconv.Itoa(c.ClientBurst))
	}
	return append(args, c.PluginArgs...), append(env, c.PluginEnv...), socket
}

// Result are the measurements of a run.
type Result struct {
	Prepare, Unprepare []time.Duration
	// ClaimRead is the latency of the same claim read the plugin makes at
	// prepare, made by the benchmark just before each prepare: the API
	// server's share of a prepare.
	ClaimRead []time.Duration
	// Memory is the plugin's /proc status memory lines at the end (VmHWM,
	// VmRSS, RssAnon, RssFile): file-backed pages are the binary's.
	Memory string
	// PeakRSS is the plugin's VmHWM at the end, in bytes.
	PeakRSS int64
}

// Percentile is the p-th percentile (0..1) of the latencies, nearest rank.
func Percentile(lat []time.Duration, p float64) time.Duration {
	if len(lat) == 0 {
		return 0
	}
	s := append([]time.Duration(nil), lat...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[int(p*float64(len(s)-1)+0.5)]
}

// Line is the one-line summary make bench-prepare prints last.
func (r Result) Line() string {
	ms := func(d time.Duration) string { return strconv.FormatFloat(float64(d.Microseconds())/1000, 'f', 2, 64) }
	return fmt.Sprintf("prepare p50=%s p90=%s p99=%s max=%s unprepare p50=%s p99=%s max=%s rss=%s",
		ms(Percentile(r.Prepare, 0.5)), ms(Percentile(r.Prepare, 0.9)), ms(Percentile(r.Prepare, 0.99)), ms(Percentile(r.Prepare, 1)),
		ms(Percentile(r.Unprepare, 0.5)), ms(Percentile(r.Unprepare, 0.99)), ms(Percentile(r.Unprepare, 1)),
		strconv.FormatFloat(float64(r.PeakRSS)/(1<<20), 'f', 1, 64))
}

const (
	defaultNode  = "bench-node"
	gpudraDriver = "gpu.gpudra.dev"
	// nodeLabel marks the claims of a run, by node.
	nodeLabel = "prepbench.gpudra.dev/node"
)

// Run starts a control plane (or uses Config.Cluster), the plugin and the
// claims, and measures.
func Run(ctx context.Context, cfg Config) (Result, error) {
	if err := cfg.validate(); err != nil {
		return Result{}, err
	}
	logger := klog.FromContext(ctx)
	dir := cfg.Dir
	if dir == "" {
		d, err := os.MkdirTemp("", "prepb")
		if err != nil {
			return Result{}, err
		}
		if os.Getenv("PREPBENCH_KEEP") == "" {
			defer os.RemoveAll(d)
		}
		dir = d
	} else if err := os.MkdirAll(dir, 0o750); err != nil {
		return Result{}, err
	}
	cluster := cfg.Cluster
	if cluster == nil {
		if err := os.MkdirAll(filepath.Join(dir, "c"), 0o750); err != nil {
			return Result{}, err
		}
		c, err := devcluster.Start(ctx, devcluster.Options{Dir: filepath.Join(dir, "c"), Chart: cfg.Chart})
		if err != nil {
			return Result{}, err
		}
		defer c.Stop()
		cluster = c
	}
	// The benchmark's own client has no rate limit: the cluster's admin
	// client (100 QPS, burst 200) spends its burst on creating the claims,
	// and its limiter then held every claim read for a token (p50 5.7 ms
	// where the API server answers in 1.5), pacing the prepares instead of
	// running them back to back.
	restCfg := rest.CopyConfig(cluster.RESTConfig)
	restCfg.QPS, restCfg.Burst = -1, 0
	unlimited, err := kubernetes.NewForConfig(restCfg)
	if err != nil {
		return Result{}, err
	}
	var client kubernetes.Interface = unlimited
	if cfg.Paced {
		client = cluster.Client
	}
	node := cfg.node()
	if _, err := client.CoreV1().Nodes().Create(ctx, &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return Result{}, err
	}
	sa := chart.PluginServiceAccount
	if cfg.Foreign != nil {
		if err := foreignIdentity(ctx, client, cfg.Foreign); err != nil {
			return Result{}, err
		}
		sa = ForeignServiceAccount
	}
	paths := Paths{Node: node, Kubeconfig: filepath.Join(dir, "kubeconfig"), PluginsDir: filepath.Join(dir, "plugins"),
		RegistrarDir: filepath.Join(dir, "registry"), CDIDir: filepath.Join(dir, "cdi"), Devices: cfg.Devices}
	// As the DaemonSet's pod: its ServiceAccount, a token bound to the
	// Node.
	if err := cluster.WriteNodeComponentKubeconfig(ctx, paths.Kubeconfig, sa, node); err != nil {
		return Result{}, err
	}
	for _, d := range []string{paths.PluginsDir, paths.RegistrarDir, paths.CDIDir} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return Result{}, err
		}
	}
	args, env, socket := cfg.Command(paths)
	plugin := exec.Command(cfg.PluginBinary, args...)
	if len(env) > 0 {
		plugin.Env = append(os.Environ(), env...)
	}
	logFile, err := os.Create(filepath.Join(dir, "plugin.log"))
	if err != nil {
		return Result{}, err
	}
	defer logFile.Close()
	plugin.Stdout, plugin.Stderr = logFile, logFile
	if err := plugin.Start(); err != nil {
		return Result{}, fmt.Errorf("start %s: %w", cfg.PluginBinary, err)
	}
	defer func() {
		_ = plugin.Process.Signal(syscall.SIGTERM)
		done := make(chan struct{})
		go func() { _ = plugin.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			_ = plugin.Process.Kill()
		}
	}()
	if err := waitReady(ctx, client, socket, node); err != nil {
		return Result{}, fmt.Errorf("%s plugin not ready (log: %s): %w", cfg.name(), logFile.Name(), err)
	}
	claims, err := createClaims(ctx, client, cfg)
	if err != nil {
		return Result{}, err
	}
	if cfg.Cluster != nil {
		defer func() {
			_ = client.ResourceV1().ResourceClaims(metav1.NamespaceDefault).DeleteCollection(context.WithoutCancel(ctx), metav1.DeleteOptions{},
				metav1.ListOptions{LabelSelector: nodeLabel + "=" + node})
		}()
	}
	logger.Info("Claims created; measuring", "plugin", cfg.name(), "claims", len(claims))

	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return Result{}, err
	}
	defer conn.Close()
	dra := drapb.NewDRAPluginClient(conn)
	var res Result
	for i, c := range claims {
		// Allocated just before its prepare, and released after its
		// unprepare, as a pod's claim is: a device is allocated to one
		// claim at a time. Not timed.
		if c, err = allocate(ctx, client, c, cfg, i); err != nil {
			return res, err
		}
		req := []*drapb.Claim{{Namespace: c.Namespace, Name: c.Name, Uid: string(c.UID)}}
		readStart := time.Now()
		if _, err := client.ResourceV1().ResourceClaims(c.Namespace).Get(ctx, c.Name, metav1.GetOptions{}); err != nil {
			return res, err
		}
		res.ClaimRead = append(res.ClaimRead, time.Since(readStart))
		start := time.Now()
		prep, err := dra.NodePrepareResources(ctx, &drapb.NodePrepareResourcesRequest{Claims: req})
		if err != nil {
			return res, fmt.Errorf("prepare %s: %w", c.Name, err)
		}
		if e := prep.Claims[string(c.UID)].GetError(); e != "" {
			return res, fmt.Errorf("prepare %s: %s", c.Name, e)
		}
		mid := time.Now()
		un, err := dra.NodeUnprepareResources(ctx, &drapb.NodeUnprepareResourcesRequest{Claims: req})
		if err != nil {
			return res, fmt.Errorf("unprepare %s: %w", c.Name, err)
		}
		if e := un.Claims[string(c.UID)].GetError(); e != "" {
			return res, fmt.Errorf("unprepare %s: %s", c.Name, e)
		}
		res.Prepare, res.Unprepare = append(res.Prepare, mid.Sub(start)), append(res.Unprepare, time.Since(mid))
		if err := deallocate(ctx, client, c); err != nil {
			return res, err
		}
	}
	res.PeakRSS, res.Memory, err = memory(plugin.Process.Pid)
	return res, err
}

// foreignIdentity creates (or updates) the ServiceAccount a Foreign plugin
// runs as, with its rules.
func foreignIdentity(ctx context.Context, client kubernetes.Interface, f *Foreign) error {
	ns := chart.PluginNamespace
	sa := &v1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: ForeignServiceAccount, Namespace: ns}}
	if _, err := client.CoreV1().ServiceAccounts(ns).Create(ctx, sa, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	role := &rbacv1.ClusterRole{ObjectMeta: metav1.ObjectMeta{Name: ForeignServiceAccount}, Rules: f.Rules}
	if _, err := client.RbacV1().ClusterRoles().Create(ctx, role, metav1.CreateOptions{}); apierrors.IsAlreadyExists(err) {
		if _, err := client.RbacV1().ClusterRoles().Update(ctx, role, metav1.UpdateOptions{}); err != nil {
			return err
		}
	} else if err != nil {
		return err
	}
	binding := &rbacv1.ClusterRoleBinding{ObjectMeta: metav1.ObjectMeta{Name: ForeignServiceAccount},
		RoleRef:  rbacv1.RoleRef{APIGroup: rbacv1.GroupName, Kind: "ClusterRole", Name: ForeignServiceAccount},
		Subjects: []rbacv1.Subject{{Kind: rbacv1.ServiceAccountKind, Name: ForeignServiceAccount, Namespace: ns}}}
	if _, err := client.RbacV1().ClusterRoleBindings().Create(ctx, binding, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		return err
	}
	return nil
}

// waitReady waits for the DRA socket and the node's slices.
func waitReady(ctx context.Context, client kubernetes.Interface, socket, node string) error {
	return wait.PollUntilContextTimeout(ctx, 100*time.Millisecond, 60*time.Second, true, func(ctx context.Context) (bool, error) {
		if _, err := os.Stat(socket); err != nil {
			return false, nil
		}
		slices, err := client.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
		if err != nil {
			return false, nil
		}
		for _, s := range slices.Items {
			if s.Spec.Pool.Name == node {
				return true, nil
			}
		}
		return false, nil
	})
}

// memory is the process's VmHWM in bytes, and its memory lines.
func memory(pid int) (int64, string, error) {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, "", err
	}
	defer f.Close()
	var hwm int64 = -1
	var lines []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		name, v, _ := strings.Cut(sc.Text(), ":")
		v = strings.TrimSpace(v)
		switch name {
		case "VmHWM":
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(v, "kB")), 10, 64)
			if err != nil {
				return 0, "", fmt.Errorf("VmHWM %q: %w", v, err)
			}
			hwm = kb << 10
			fallthrough
		case "VmRSS", "RssAnon", "RssFile":
			lines = append(lines, name+"="+strings.ReplaceAll(v, " ", ""))
		}
	}
	if hwm < 0 {
		return 0, "", errors.New("no VmHWM in /proc/<pid>/status")
	}
	return hwm, strings.Join(lines, " "), nil
}
