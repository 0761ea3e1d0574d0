// Package ray_test runs KubeRay's real operator (v1.5, devcluster/kuberay)
// against a devcluster with simulated DGX H100 nodes: Ray clusters whose
// workers get their GPUs from gpudra through ResourceClaimTemplates
// (examples/ray, docs/ray.md). Every container runs devcluster's probe as
// its process: no Ray image runs here, so no Ray process starts; what is
// tested is what KubeRay and Kubernetes do with the workers' GPUs.
package ray_test

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/devcluster/noderuntime"
	"github.com/gpudra/gpudra/devcluster/rayoperator"
)

// The nodes: one DGX H100 in MIG mode (the small MIG workers), two with
// MIG off (8-GPU workers, one per node), and one H100 shared through
// consumable capacity (the serving shares).
const (
	migNode        = "dgx-h100-0"
	fractionalNode = "h100-fractional-0"
)

var (
	cluster  *devcluster.Cluster
	operator *rayoperator.Operator
	examples = filepath.Join("..", "..", "..", "examples")
)

func TestMain(m *testing.M) {
	flag.Parse()
	os.Exit(run(m))
}

func run(m *testing.M) int {
	if os.Getenv(rayoperator.BinaryEnv) == "" {
		if os.Getenv("GPUDRA_REQUIRE_KUBERAY") != "" {
			fmt.Fprintf(os.Stderr, "FAIL: %s is not set: make kuberay builds it (make test-e2e sets it)\n", rayoperator.BinaryEnv)
			return 1
		}
		fmt.Printf("SKIP: Ray's e2e tests: %s is not set (make kuberay; make test-e2e sets it)\n", rayoperator.BinaryEnv)
		return 0
	}
	logDir, err := os.MkdirTemp("", "gpudra-e2e-ray-logs")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	logFile := filepath.Join(logDir, "devcluster.log")
	klogFlags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(klogFlags)
	for k, v := range map[string]string{"logtostderr": "false", "alsologtostderr": "false",
		"stderrthreshold": "FATAL", "log_file": logFile, "one_output": "true", "v": "2"} {
		_ = klogFlags.Set(k, v)
	}
	defer klog.Flush()
	ctx := context.Background()
	start := time.Now()
	mpsControl, err := filepath.Abs("../../../hack/fake-nvidia-cuda-mps-control")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	opts := devcluster.Options{MPSControlBinary: mpsControl, Chart: chart.Default("../../..")}
	if runc, probe := os.Getenv("RUNC"), os.Getenv("PROBE"); runc != "" && probe != "" {
		opts.Runtime = &noderuntime.OCIRuntime{Runc: runc, Probe: probe, MPSServer: os.Getenv("MPS_SERVER")}
	}
	cluster, err = devcluster.Start(ctx, opts)
	if err != nil {
		fmt.Fprintln(os.Stderr, "start devcluster:", err, "(log:", logFile+")")
		return 1
	}
	defer cluster.Stop()
	nodes := []nodeagent.NodeOptions{{Name: migNode, Machine: "dgx-h100"},
		{Name: "dgx-h100-1", Machine: "dgx-h100-nomig"}, {Name: "dgx-h100-2", Machine: "dgx-h100-nomig"},
		nodeagent.FractionalNode(fractionalNode, filepath.Join(examples, "machines", "one-h100.yaml"))}
	for _, opts := range nodes {
		n, err := cluster.AddNode(ctx, opts)
		if err == nil {
			err = n.WaitForSlices(ctx)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, "add node:", err, "(log:", logFile+")")
			return 1
		}
	}
	if _, err := cluster.ApplyFiles(ctx, "", filepath.Join(examples, "deviceclasses")); err != nil {
		fmt.Fprintln(os.Stderr, "device classes:", err)
		return 1
	}
	operator, err = rayoperator.Start(ctx, cluster, rayoperator.Options{})
	if err != nil {
		fmt.Fprintln(os.Stderr, "start KubeRay's operator:", err, "(log:", logFile+")")
		return 1
	}
	fmt.Printf("devcluster with 3 simulated DGX H100 nodes, a fractional H100 and KubeRay's operator ready in %s; logs: %s, %s\n",
		time.Since(start).Round(time.Millisecond), logFile, operator.Log)
	code := m.Run()
	operator.Stop()
	// The cluster's directory goes at Stop: keep the operator's log with ours.
	if b, err := os.ReadFile(operator.Log); err == nil {
		_ = os.WriteFile(filepath.Join(logDir, "kuberay-operator.log"), b, 0o600)
		// The operator runs as its own ServiceAccount: a call its RBAC
		// (devcluster/rayoperator/kuberay-rbac.yaml) lacks fails the suite.
		for _, line := range rayoperator.Forbidden(b) {
			fmt.Fprintln(os.Stderr, "FAIL: KubeRay's operator made a call its RBAC forbids:", line)
			code = 1
		}
	}
	if calls := cluster.TakeForbidden(); len(calls) > 0 {
		fmt.Fprintln(os.Stderr, "FAIL: gpudra components made calls the chart's RBAC or admission policies forbid:")
		for _, call := range calls {
			fmt.Fprintln(os.Stderr, "  ", call)
		}
		code = 1
	}
	if code == 0 && os.Getenv("GPUDRA_E2E_KEEP_LOG") == "" {
		_ = os.RemoveAll(logDir)
	} else {
		fmt.Println("devcluster log kept at", logFile, "and KubeRay's at", filepath.Join(logDir, "kuberay-operator.log"))
	}
	return code
}
