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
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/kubernetes"
	"k8s.io/klog/v2"
	drapb "k8s.io/kubelet/pkg/apis/dra/v1"

	"github.com/gpudra/gpudra/devcluster"
)

// Config of one run.
type Config struct {
	// PluginBinary is gpudra-kubelet-plugin, built as shipped.
	PluginBinary string
	// Claims is how many 1-GPU claims are prepared and unprepared, one
	// after the other.
	Claims int
	// Machine is the simulated machine (--sim-machine).
	Machine string
	// DeviceFormat names a claim's device from its index modulo Devices
	// (fmt verb %d); empty: "gpu-%d", a whole GPU.
	DeviceFormat string
	Devices      int
	// PluginArgs are added to the plugin's flags (for example
	// --kube-api-qps to compare client settings).
	PluginArgs []string
	// Dir is where the cluster and the plugin keep their files; empty: a
	// temporary directory.
	Dir string
	// Chart gives the cluster its identities; the plugin runs as the
	// chart's ServiceAccount.
	Chart devcluster.ChartOptions
}

func (c Config) deviceFormat() string {
	if c.DeviceFormat == "" {
		return "gpu-%d"
	}
	return c.DeviceFormat
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
	return fmt.Sprintf("prepare p50=%s p90=%s p99=%s unprepare p50=%s p99=%s rss=%s",
		ms(Percentile(r.Prepare, 0.5)), ms(Percentile(r.Prepare, 0.9)), ms(Percentile(r.Prepare, 0.99)),
		ms(Percentile(r.Unprepare, 0.5)), ms(Percentile(r.Unprepare, 0.99)),
		strconv.FormatFloat(float64(r.PeakRSS)/(1<<20), 'f', 1, 64))
}

const (
	node   = "bench-node"
	driver = "gpu.gpudra.dev"
)

// Run starts a control plane, the plugin and the claims, and measures.
func Run(ctx context.Context, cfg Config) (Result, error) {
	if cfg.Claims <= 0 || cfg.Devices <= 0 {
		return Result{}, errors.New("Claims and Devices must be positive")
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
	}
	if err := os.MkdirAll(filepath.Join(dir, "c"), 0o750); err != nil {
		return Result{}, err
	}
	cluster, err := devcluster.Start(ctx, devcluster.Options{Dir: filepath.Join(dir, "c"), Chart: cfg.Chart})
	if err != nil {
		return Result{}, err
	}
	defer cluster.Stop()
	client := cluster.Client
	if _, err := client.CoreV1().Nodes().Create(ctx, &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: node}}, metav1.CreateOptions{}); err != nil {
		return Result{}, err
	}
	kubeconfig := filepath.Join(dir, "kubeconfig")
	// As the DaemonSet's pod: the chart's ServiceAccount, a token bound to
	// the Node.
	if err := cluster.WriteNodeComponentKubeconfig(ctx, kubeconfig, devcluster.PluginServiceAccount, node); err != nil {
		return Result{}, err
	}
	pluginDir, registry, cdiDir := filepath.Join(dir, "plugin"), filepath.Join(dir, "registry"), filepath.Join(dir, "cdi")
	for _, d := range []string{pluginDir, registry, cdiDir} {
		if err := os.MkdirAll(d, 0o750); err != nil {
			return Result{}, err
		}
	}
	args := append([]string{"--node-name=" + node, "--kubeconfig=" + kubeconfig, "--backend=sim", "--sim-machine=" + cfg.Machine,
		"--plugin-data-dir=" + pluginDir, "--registrar-dir=" + registry, "--cdi-dir=" + cdiDir, "--metrics-address=", "-v=0"}, cfg.PluginArgs...)
	plugin := exec.Command(cfg.PluginBinary, args...)
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
	socket := filepath.Join(pluginDir, "dra.sock")
	if err := waitReady(ctx, client, socket); err != nil {
		return Result{}, fmt.Errorf("plugin not ready (log: %s): %w", logFile.Name(), err)
	}
	claims, err := createClaims(ctx, client, cfg)
	if err != nil {
		return Result{}, err
	}
	logger.Info("Claims allocated; measuring", "claims", len(claims))

	conn, err := grpc.NewClient("unix://"+socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return Result{}, err
	}
	defer conn.Close()
	dra := drapb.NewDRAPluginClient(conn)
	var res Result
	for _, c := range claims {
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
	}
	res.PeakRSS, res.Memory, err = memory(plugin.Process.Pid)
	return res, err
}

// waitReady waits for the DRA socket and the node's slices.
func waitReady(ctx context.Context, client kubernetes.Interface, socket string) error {
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

// createClaims creates the claims and allocates each to one GPU of the
// node, as the scheduler would (status.allocation and reservedFor).
func createClaims(ctx context.Context, client kubernetes.Interface, cfg Config) ([]*resourceapi.ResourceClaim, error) {
	out := make([]*resourceapi.ResourceClaim, 0, cfg.Claims)
	for i := 0; i < cfg.Claims; i++ {
		c := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("bench-%03d", i), Namespace: metav1.NamespaceDefault},
			Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
				Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: driver}}}}}}
		c, err := client.ResourceV1().ResourceClaims(c.Namespace).Create(ctx, c, metav1.CreateOptions{})
		if err != nil {
			return nil, err
		}
		c.Status.Allocation = &resourceapi.AllocationResult{
			Devices: resourceapi.DeviceAllocationResult{Results: []resourceapi.DeviceRequestAllocationResult{{
				Request: "gpu", Driver: driver, Pool: node, Device: fmt.Sprintf(cfg.deviceFormat(), i%cfg.Devices)}}},
			NodeSelector: &v1.NodeSelector{NodeSelectorTerms: []v1.NodeSelectorTerm{{MatchFields: []v1.NodeSelectorRequirement{{
				Key: "metadata.name", Operator: v1.NodeSelectorOpIn, Values: []string{node}}}}}},
		}
		c.Status.ReservedFor = []resourceapi.ResourceClaimConsumerReference{{Resource: "pods", Name: c.Name, UID: types.UID(fmt.Sprintf("00000000-0000-0000-0000-%012d", i))}}
		if c, err = client.ResourceV1().ResourceClaims(c.Namespace).UpdateStatus(ctx, c, metav1.UpdateOptions{}); err != nil {
			return nil, fmt.Errorf("allocate %s: %w", c.Name, err)
		}
		out = append(out, c)
	}
	return out, nil
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
