// Command devcluster runs a real Kubernetes control plane in this process
// with simulated DGX H100 nodes running the gpudra kubelet plugin, applies
// the examples and prints where every pod landed and what it would see.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/devcluster/imagemode"
	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/devcluster/noderuntime"
	"github.com/gpudra/gpudra/devcluster/realnode"
	"github.com/gpudra/gpudra/pkg/plugin"
)

type options struct {
	machines   string
	examples   string
	only       stringList
	namespace  string
	kubeconfig string
	logFile    string
	keep       bool
	fractional bool
	mpsControl string
	timeout    time.Duration
	cpQPS      float64
	cpBurst    int
	grove      bool
	chart      chart.Options
	runtime    noderuntime.OCIRuntime
	image      imagemode.Options
	realNode   realNodeOptions
}

// realNodeOptions are --real-node's: a node run by the kubelet binary and
// containerd beside the simulated ones (make demo-real-node).
type realNodeOptions struct {
	bin, image, machine string
	examples            stringList
}

// defaultRealNodeExamples are the examples --real-node pins to the real
// node; the others run on the simulated nodes.
var defaultRealNodeExamples = []string{"single-gpu", "nvlink-pair", "mig", "shared-claim", "time-slicing", "mps"}

type stringList []string

func (s *stringList) String() string     { return fmt.Sprint(*s) }
func (s *stringList) Set(v string) error { *s = append(*s, v); return nil }

// defaultExamples are the feature folders the demo applies, in this order.
var defaultExamples = []string{"single-gpu", "nvlink-pair", "mig", "prioritized-list", "shared-claim", "cel-selector",
	"time-slicing", "mps", "fractional", "grove"}

func main() {
	var o options
	fs := flag.NewFlagSet("devcluster", flag.ExitOnError)
	fs.StringVar(&o.machines, "machines", "dgx-h100,dgx-h100-nomig", "one simulated GPU node per entry: a builtin machine (dgx-h100 has MIG mode on, dgx-h100-nomig off, h100-pcie, h100-pcie-nvlink, h100-nvlink-fabric, hgx-h200 (MIG on), hgx-h200-nomig) or a spec file; nodes are named dgx-h100-0, dgx-h100-1, ... after the first")
	fs.BoolVar(&o.fractional, "fractional-node", true, "add h100-fractional-0: one H100 shared through consumable capacity, tainted gpu.gpudra.dev/fractional")
	fs.StringVar(&o.mpsControl, "mps-control-binary", "hack/fake-nvidia-cuda-mps-control", "what the plugins run as nvidia-cuda-mps-control (a stand-in that records commands)")
	fs.BoolVar(&o.grove, "grove", true, "install Grove's CRDs and run devcluster's stand-in for the Grove operator (examples/grove)")
	fs.StringVar(&o.examples, "examples", "examples", "the examples directory")
	fs.Var(&o.only, "example", "an example folder to apply (repeatable; default: all of them)")
	fs.StringVar(&o.namespace, "namespace", "default", "namespace for the examples")
	fs.StringVar(&o.kubeconfig, "kubeconfig", "devcluster.kubeconfig", "where to write a kubeconfig for kubectl")
	fs.StringVar(&o.logFile, "log-file", "devcluster.log", "the control plane's and the plugins' logs")
	fs.BoolVar(&o.keep, "keep", false, "keep the cluster running until interrupted")
	fs.DurationVar(&o.timeout, "timeout", 2*time.Minute, "how long to wait for the example pods")
	fs.StringVar(&o.runtime.Runc, "runc", "bin/runc", "runc, to run the pods' containers for real (make builds it); missing, or not root: the containers' specs are only resolved")
	fs.StringVar(&o.runtime.Probe, "probe", "bin/gpudra-probe", "the process of the real containers (make probe)")
	fs.StringVar(&o.image.Layout, "image", "", "make image's OCI layout (bin/image/oci): run the chart's own kubelet plugin and controller pods from it, in runc, instead of in this process (make demo-image; needs root)")
	fs.StringVar(&o.runtime.MPSServer, "mps-server", "bin/gpudra-mps-server", "a static gpudra-mps-server, to run MPS server pods as real containers too (make probe); missing: they run in this process")
	fs.Float64Var(&o.cpQPS, "control-plane-qps", 0, "client QPS of the scheduler and of each controller; 0: the limits they ship with (kube-scheduler 50, kube-controller-manager 20 per controller)")
	fs.IntVar(&o.cpBurst, "control-plane-burst", 0, "client burst of the scheduler and of each controller; 0: twice --control-plane-qps if set, else the shipped limits (100, 30)")
	fs.StringVar(&o.realNode.bin, "real-node", "", "make real-node's directory (bin/real-node): add real-node-0, run by the kubelet binary and containerd, with the chart's plugin pod from --real-node-image, and run the --real-node-example examples there (make demo-real-node; needs root)")
	fs.StringVar(&o.realNode.image, "real-node-image", "", "make image's docker tarball for this machine's architecture, which the real node's containerd imports")
	fs.StringVar(&o.realNode.machine, "real-node-machine", "examples/machines/dgx-h100-mig67.yaml", "the real node's simulated machine (GPUs 6 and 7 in MIG mode, every MIG placement published)")
	fs.Var(&o.realNode.examples, "real-node-example", "an example folder to run on the real node instead of the simulated ones (repeatable; default: "+strings.Join(defaultRealNodeExamples, ", ")+")")
	o.chart = chart.Default(".")
	fs.StringVar(&o.chart.Dir, "chart", o.chart.Dir, "the gpudra chart: its ServiceAccounts, RBAC and admission policies are installed, and every gpudra component runs as its ServiceAccount")
	fs.StringVar(&o.chart.Helm, "helm", o.chart.Helm, "helm, to render the chart (make helm builds bin/helm; env HELM)")
	klogFlags := flag.NewFlagSet("klog", flag.ExitOnError)
	klog.InitFlags(klogFlags)
	fs.Func("v", "log verbosity (in the log file)", func(v string) error { return klogFlags.Set("v", v) })
	_ = fs.Parse(os.Args[1:])
	// The control plane logs a lot: into the file, not onto the terminal.
	for k, v := range map[string]string{"logtostderr": "false", "alsologtostderr": "false",
		"stderrthreshold": "FATAL", "log_file": o.logFile, "one_output": "true"} {
		_ = klogFlags.Set(k, v)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, o); err != nil {
		fmt.Fprintln(os.Stderr, "devcluster:", err)
		klog.Flush()
		os.Exit(1)
	}
	klog.Flush()
}

// nodeBase names nodes after a builtin machine, or "gpu-node" for a spec file.
func nodeBase(machine string) string {
	if _, err := os.Stat(machine); err == nil {
		return "gpu-node"
	}
	return machine
}

func run(ctx context.Context, o options) error {
	start := time.Now()
	step := func(format string, args ...any) {
		fmt.Printf("[%5.1fs] %s\n", time.Since(start).Seconds(), fmt.Sprintf(format, args...))
	}
	step("starting etcd, kube-apiserver, kube-scheduler and the DRA controllers (logs: %s)", o.logFile)
	if o.cpQPS < 0 || o.cpBurst < 0 {
		return fmt.Errorf("--control-plane-qps and --control-plane-burst cannot be negative")
	}
	mpsControl, err := filepath.Abs(o.mpsControl)
	if err != nil {
		return err
	}
	var runtime *noderuntime.OCIRuntime
	if err := o.runtime.Usable(); err != nil {
		fmt.Fprintf(os.Stderr, "containers are not run, their OCI specs only resolved: %v\n", err)
	} else {
		rt := o.runtime
		if rt.Runc, err = filepath.Abs(rt.Runc); err != nil {
			return err
		}
		if rt.Probe, err = filepath.Abs(rt.Probe); err != nil {
			return err
		}
		if _, err := os.Stat(rt.MPSServer); err != nil {
			fmt.Fprintf(os.Stderr, "MPS server pods run in this process, not in containers: %v\n", err)
			rt.MPSServer = ""
		} else if rt.MPSServer, err = filepath.Abs(rt.MPSServer); err != nil {
			return err
		}
		runtime = &rt
	}
	var image *imagemode.Options
	if o.image.Layout != "" {
		if runtime == nil {
			return fmt.Errorf("--image runs the chart's pods in runc: %w", o.runtime.Usable())
		}
		image = &imagemode.Options{Layout: o.image.Layout, Runc: runtime.Runc}
		step("the chart's plugin and controller pods run from the image %s", o.image.Layout)
	}
	if o.realNode.bin != "" && image != nil {
		return fmt.Errorf("--real-node and --image: the real node runs the chart's plugin pod from --real-node-image; use one")
	}
	c, err := devcluster.Start(ctx, devcluster.Options{MPSControlBinary: mpsControl, Chart: o.chart,
		ControlPlaneQPS: float32(o.cpQPS), ControlPlaneBurst: o.cpBurst, Grove: o.grove, Runtime: runtime, Image: image,
		RealNodes: o.realNode.bin != ""})
	if err != nil {
		return err
	}
	if o.cpQPS > 0 || o.cpBurst > 0 {
		step("control plane clients: %s", c.ControlPlaneClients)
	}
	defer func() {
		step("stopping the cluster")
		c.Stop()
	}()
	for i, machine := range strings.Split(o.machines, ",") {
		name := fmt.Sprintf("%s-%d", strings.TrimSuffix(nodeBase(strings.Split(o.machines, ",")[0]), "-nomig"), i)
		n, err := c.AddNode(ctx, nodeagent.NodeOptions{Name: name, Machine: machine})
		if err != nil {
			return err
		}
		if err := n.WaitForSlices(ctx); err != nil {
			return fmt.Errorf("node %s: slices not published: %w", name, err)
		}
		step("node %s: simulated %s, gpudra kubelet plugin registered and its ResourceSlices published", name, machine)
	}
	if o.fractional && image != nil {
		step("no fractional node: in image mode --fractional-gpus is the chart's value for every node (kubeletPlugin.fractionalGPUs)")
	} else if o.fractional {
		n, err := c.AddNode(ctx, nodeagent.FractionalNode("h100-fractional-0", filepath.Join(o.examples, "machines", "one-h100.yaml")))
		if err != nil {
			return err
		}
		if err := n.WaitForSlices(ctx); err != nil {
			return fmt.Errorf("node %s: slices not published: %w", n.Name, err)
		}
		step("node %s: one H100 shared through consumable capacity (--fractional-gpus)", n.Name)
	}
	onRealNode := map[string]bool{}
	if o.realNode.bin != "" {
		if err := addRealNode(ctx, c, o.realNode, o.runtime.Probe, step); err != nil {
			return err
		}
		examples := o.realNode.examples
		if len(examples) == 0 {
			examples = defaultRealNodeExamples
		}
		for _, e := range examples {
			onRealNode[e] = true
		}
	}
	if err := c.WriteKubeconfig(o.kubeconfig); err != nil {
		return err
	}
	abs, _ := filepath.Abs(o.kubeconfig)
	step("kubeconfig written: export KUBECONFIG=%s", abs)

	folders := o.only
	if len(folders) == 0 {
		folders = defaultExamples
	}
	if _, err := c.ApplyFiles(ctx, o.namespace, filepath.Join(o.examples, "deviceclasses")); err != nil {
		return err
	}
	for _, f := range folders {
		objs, err := devcluster.Manifests(filepath.Join(o.examples, f))
		if err != nil {
			return fmt.Errorf("example %s: %w", f, err)
		}
		where := ""
		if onRealNode[f] {
			if err := devcluster.PinToRealNode(objs, realNodeName); err != nil {
				return fmt.Errorf("example %s: %w", f, err)
			}
			where = " on " + realNodeName + " (its containers run the probe image)"
		}
		if err := c.Apply(ctx, o.namespace, objs); err != nil {
			return fmt.Errorf("example %s: %w", f, err)
		}
		step("applied examples/%s%s", f, where)
	}
	if o.grove {
		if err := c.WaitForGrovePods(ctx, o.namespace, o.timeout); err != nil {
			return err
		}
	}
	notRunning, waitErr := c.WaitForPods(ctx, o.namespace, o.timeout)
	step("example pods: %d not running", len(notRunning))
	reports, err := devcluster.ReportPods(ctx, c.Client, o.namespace)
	if err != nil {
		return err
	}
	if err := c.AddRealNodeViews(ctx, reports); err != nil {
		return err
	}
	fmt.Println()
	if err := devcluster.PrintReport(os.Stdout, reports); err != nil {
		return err
	}
	fmt.Println()
	if waitErr != nil {
		return waitErr
	}
	if o.keep {
		step("running until interrupted (Ctrl-C); try: KUBECONFIG=%s kubectl get pods,resourceclaims,resourceslices -A", abs)
		<-ctx.Done()
	}
	return nil
}

// realNodeName is the name --real-node gives its node.
const realNodeName = "real-node-0"

// addRealNode starts the real node with the chart's plugin pod from the
// image; its Node is annotated to publish every MIG placement.
func addRealNode(ctx context.Context, c *devcluster.Cluster, o realNodeOptions, probeBinary string, step func(string, ...any)) error {
	if o.image == "" {
		return fmt.Errorf("--real-node needs --real-node-image (make image's tarball for this machine)")
	}
	abs := func(p string) string { a, _ := filepath.Abs(p); return a }
	bin := abs(o.bin)
	probe := abs(probeBinary)
	b := realnode.Binaries{Kubelet: filepath.Join(bin, "kubelet"), Containerd: filepath.Join(bin, "containerd"),
		Shim: filepath.Join(bin, "containerd-shim-runc-v2"), Ctr: filepath.Join(bin, "ctr"), Runc: filepath.Join(bin, "runc"),
		CNI: filepath.Join(bin, "cni"), Pause: filepath.Join(bin, "pause"), Probe: probe, MPSControl: filepath.Join(bin, "nvidia-cuda-mps-control")}
	if _, err := c.AddRealNode(ctx, devcluster.RealNodeOptions{Name: realNodeName, Binaries: b, Image: abs(o.image), Machine: abs(o.machine),
		Annotations: map[string]string{plugin.AnnotationMigDevices: "all"}}); err != nil {
		return err
	}
	step("node %s: the kubelet binary and containerd, the chart's plugin pod from %s, simulated %s", realNodeName, o.image, o.machine)
	return nil
}
