// Package gpusmoke runs devcluster's path on a real NVIDIA GPU: the same
// plugin, kubelet, CDI specs and runc as the simulated nodes, with NVML
// behind one node (make gpu-smoke, docs/gpu-smoke.md). With
// Config.Simulated the same program runs over a simulated GPU with
// stand-ins for nvidia-smi and libcuda, so that its own flow is tested
// where no GPU is (the e2e suite).
//
// It is a product: make gpu-smoke-bundle packs cmd/gpu-smoke with the
// plugin, runc and the chart rendered ahead into the tarball a customer runs
// on a new GPU node. It lives in a module of its own beside devcluster's, as
// the benchmarks do (bench/); its prepare timings are the prepare
// benchmark's harness (bench/prepbench) run on the node.
package gpusmoke

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/devcluster/noderuntime"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// Config is where the binaries and the driver are, and what to run.
type Config struct {
	Runc, Probe string
	// CUDACheck is gpudra-cuda-check, run inside the containers (their
	// image is the host's /usr, which has the libc it needs).
	CUDACheck string
	// MPSServer is the static gpudra-mps-server: MPS server pods run as
	// real containers with it.
	MPSServer string
	// DriverRoot is where the NVIDIA driver is installed ("/").
	DriverRoot string
	// Chart is the gpudra chart: its ServiceAccounts, RBAC and
	// DeviceClasses are installed.
	Chart chart.Options
	// Results, when set, is a directory that receives what the run saw:
	// comparison, slices, each pod's report, timings and RESULT.
	Results string
	// Simulated, when set, is a simulated machine (a builtin name) behind
	// the GPU node instead of NVML, with stand-ins for nvidia-smi and
	// libcuda in its driver root: the same flow where no GPU is.
	Simulated string
	// MPSControl is what the simulated machine's driver runs as
	// nvidia-cuda-mps-control (devcluster's stand-in,
	// hack/fake-nvidia-cuda-mps-control); unused on a real GPU.
	MPSControl string
	// FakeLibCUDA is the simulated driver's libcuda.so (built from
	// pkg/nvdevice/sim/fakecuda/libcuda.c); used with Simulated.
	FakeLibCUDA string
	// LogFile is where the cluster's log goes; its last errors are part
	// of the diagnostics.
	LogFile string
	// OpenNVML opens the NVML backend; nil where the program was built
	// without cgo (only Simulated runs then).
	OpenNVML func(ctx context.Context, driverRoot string) (nvdevice.Interface, func(), error)
	// MPSPinnedMemory is the MPS claim's pinned-memory limit; the MPS
	// clients allocate half of it and one and a half times it.
	MPSPinnedMemory string
	// Timing, when its PluginBinary is set, times prepare and unprepare
	// on the GPU's backend and on a simulated node (timing.go).
	Timing TimingConfig
	// PodTimeout bounds each wait for pods (default 3 minutes).
	PodTimeout time.Duration
}

const (
	// GPUNode is the node backed by the GPU under test (NVML, or the
	// simulated machine of Config.Simulated).
	GPUNode = "nvml-gpu"
	// simNode is the simulated node beside it.
	simNode   = "sim-h100"
	namespace = "gpu-smoke"
	// ResultFile in Config.Results holds PASS, or FAIL and the reason.
	ResultFile = "RESULT"
)

// Run runs the smoke test and writes what it saw to w and to cfg.Results;
// an error says what failed, in one line.
func Run(ctx context.Context, w io.Writer, cfg Config) error {
	res, err := newResults(cfg.Results)
	if err != nil {
		return err
	}
	err = run(ctx, w, res, cfg)
	if werr := res.writeResult(err); werr != nil && err == nil {
		err = werr
	}
	return err
}

func run(ctx context.Context, w io.Writer, res *results, cfg Config) error {
	if os.Geteuid() != 0 {
		return errors.New("run as root: real containers need root")
	}
	if cfg.PodTimeout == 0 {
		cfg.PodTimeout = 3 * time.Minute
	}
	if cfg.MPSPinnedMemory == "" {
		cfg.MPSPinnedMemory = "8Gi"
	}
	for _, p := range []*string{&cfg.Runc, &cfg.Probe, &cfg.CUDACheck, &cfg.MPSServer, &cfg.FakeLibCUDA, &cfg.MPSControl} {
		if *p == "" {
			continue
		}
		abs, err := filepath.Abs(*p)
		if err != nil {
			return err
		}
		*p = abs
	}
	gpu, err := openGPU(ctx, cfg)
	if err != nil {
		return err
	}
	defer gpu.close()
	if gpu.backend != nil {
		// What NVML reports is kept first: it is worth having even where
		// the rest fails.
		inv, err := gpu.backend.Inventory(ctx)
		if err != nil {
			return fmt.Errorf("NVML inventory: %w", err)
		}
		if err := res.inventory(inv); err != nil {
			return err
		}
		if tr, ok := gpu.backend.(nvdevice.TelemetryReader); ok {
			if err := scrapeTelemetry(ctx, w, res, tr); err != nil {
				// Worth a line, not the run: telemetry is not a check.
				fmt.Fprintf(w, "telemetry: %v\n", err)
			}
		}
	}

	// The containers' image is the host's /usr (nvidia-smi and the CUDA
	// check need a libc); what GPUs they see is still only what the CDI
	// spec gives them.
	rt := &noderuntime.OCIRuntime{Runc: cfg.Runc, Probe: cfg.Probe, HostImage: true, MPSServer: cfg.MPSServer, CUDACheck: cfg.CUDACheck}
	if err := rt.Usable(); err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "gpu-smoke-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	cluster, err := devcluster.Start(ctx, devcluster.Options{Dir: dir, Chart: cfg.Chart, Runtime: rt, MPSControlBinary: gpu.mpsControl})
	if err != nil {
		return fmt.Errorf("start devcluster: %w", err)
	}
	defer cluster.Stop()
	s := &session{w: w, res: res, cfg: cfg, cluster: cluster, gpu: gpu}
	testErr := s.test(ctx)
	if testErr != nil {
		// What a person needs, while the cluster still runs.
		s.diagnose(ctx, testErr)
	}
	cluster.Stop()
	// The timings stand on their own: they are taken even where a check
	// failed, once the GPU's inventory is known.
	if cfg.Timing.PluginBinary != "" && s.inv != nil {
		if err := s.time(ctx); err != nil {
			return errors.Join(testErr, fmt.Errorf("timing prepare: %w", err))
		}
	}
	return testErr
}

// session is one run's cluster and what it found.
type session struct {
	w       io.Writer
	res     *results
	cfg     Config
	cluster *devcluster.Cluster
	gpu     *gpuUnderTest
	inv     *nvdevice.Inventory
}

// test runs everything that needs the cluster.
func (s *session) test(ctx context.Context) error {
	classes, err := s.cluster.InstallChartDeviceClasses(ctx)
	if err != nil {
		return err
	}
	fmt.Fprintf(s.w, "== the chart's DeviceClasses: %v\n", classes)
	if _, err := s.cluster.AddNode(ctx, nodeagent.NodeOptions{Name: simNode, Machine: "dgx-h100-nomig"}); err != nil {
		return err
	}
	existing := slicebuilder.MigPolicy{Existing: true}
	node, err := s.cluster.AddNode(ctx, s.gpu.nodeOptions(&existing))
	if err != nil {
		return err
	}
	if err := node.WaitForSlices(ctx); err != nil {
		return fmt.Errorf("node %s publishes no ResourceSlice: %w", GPUNode, err)
	}
	if s.inv, err = node.Backend().Inventory(ctx); err != nil {
		return fmt.Errorf("inventory of node %s: %w", GPUNode, err)
	}
	if len(s.inv.GPUs) == 0 {
		return fmt.Errorf("node %s lists no GPU", GPUNode)
	}
	if s.gpu.backend == nil {
		if err := s.res.inventory(s.inv); err != nil {
			return err
		}
	}
	published, err := sliceYAML(ctx, s.cluster.Client, GPUNode)
	if err != nil {
		return fmt.Errorf("the slices of node %s: %w", GPUNode, err)
	}
	if err := s.res.write("slices.yaml", published); err != nil {
		return err
	}
	var cmp bytesWriter
	if err := Compare(ctx, io.MultiWriter(s.w, &cmp), s.inv); err != nil {
		return err
	}
	if err := s.res.write("compare.txt", cmp.String()); err != nil {
		return err
	}
	fmt.Fprintf(s.w, "\n== devcluster: node %s (%s) beside %s (simulated)\n", GPUNode, s.gpu.describe, simNode)
	if _, err := s.cluster.Client.CoreV1().Namespaces().Create(ctx, &v1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: namespace}}, metav1.CreateOptions{}); err != nil {
		return err
	}
	if err := s.wholeGPU(ctx); err != nil {
		return err
	}
	return s.mps(ctx)
}

// bytesWriter collects what is printed, for the results directory.
type bytesWriter struct{ b []byte }

func (b *bytesWriter) Write(p []byte) (int, error) { b.b = append(b.b, p...); return len(p), nil }
func (b *bytesWriter) String() string              { return string(b.b) }
