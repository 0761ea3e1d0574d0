// Package karpenter_test runs real Karpenter (v1.15, devcluster/karpenter)
// against a devcluster that starts with no GPU node: every GPU node here is
// a machine Karpenter bought from devcluster's cloud for a pending pod
// (docs/autoscaling.md).
package karpenter_test

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
	"github.com/gpudra/gpudra/devcluster/autoscaler"
	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/devcluster/engine"
	"github.com/gpudra/gpudra/devcluster/noderuntime"
)

var (
	cluster   *devcluster.Cluster
	karpenter *autoscaler.Karpenter
	examples  = filepath.Join("..", "..", "..", "examples")
)

func TestMain(m *testing.M) {
	flag.Parse()
	os.Exit(run(m))
}

func run(m *testing.M) int {
	if os.Getenv(autoscaler.BinaryEnv) == "" {
		if os.Getenv("GPUDRA_REQUIRE_KARPENTER") != "" {
			fmt.Fprintf(os.Stderr, "FAIL: %s is not set: make karpenter builds it (make test-e2e sets it)\n", autoscaler.BinaryEnv)
			return 1
		}
		fmt.Printf("SKIP: Karpenter's e2e tests: %s is not set (make karpenter; make test-e2e sets it)\n", autoscaler.BinaryEnv)
		return 0
	}
	logDir, err := os.MkdirTemp("", "gpudra-e2e-karpenter-logs")
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
	if _, err := cluster.ApplyFiles(ctx, "", filepath.Join(examples, "deviceclasses")); err != nil {
		fmt.Fprintln(os.Stderr, "device classes:", err)
		return 1
	}
	karpenter, err = autoscaler.Start(ctx, cluster, autoscaler.Options{})
	if err != nil {
		fmt.Fprintln(os.Stderr, "start Karpenter:", err, "(log:", logFile+")")
		return 1
	}
	defer karpenter.Stop()
	if _, err := cluster.ApplyFiles(ctx, "", filepath.Join(examples, "autoscaling", "nodeclasses.yaml"), filepath.Join(examples, "autoscaling", "nodepools.yaml")); err != nil {
		fmt.Fprintln(os.Stderr, "examples/autoscaling:", err)
		return 1
	}
	fmt.Printf("devcluster with no GPU node and Karpenter ready in %s; logs: %s, %s\n", time.Since(start).Round(time.Millisecond), logFile, karpenter.Log)
	code := m.Run()
	// The cluster's directory goes at Stop: keep Karpenter's log with ours.
	if b, err := os.ReadFile(karpenter.Log); err == nil {
		_ = os.WriteFile(filepath.Join(logDir, "karpenter.log"), b, 0o600)
		// Karpenter runs as its own ServiceAccount: a call its RBAC
		// (devcluster/autoscaler/karpenter-rbac.yaml) lacks fails the suite.
		for _, line := range engine.Forbidden(b) {
			fmt.Fprintln(os.Stderr, "FAIL: Karpenter made a call its RBAC forbids:", line)
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
		fmt.Println("devcluster log kept at", logFile, "and Karpenter's at", filepath.Join(logDir, "karpenter.log"))
	}
	return code
}
