// Package enginesuite is what the e2e suites of an engine run as its own
// process (devcluster/e2e/karpenter, devcluster/e2e/ray) do before and
// after their tests: skip without the engine's binary, or fail where make
// test requires it; log to a directory of their own; start a devcluster
// with real containers where make test-e2e provides them; and at the end
// fail on any call the engine's or gpudra's RBAC refused, keeping the logs
// of a failed run.
package enginesuite

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/chart"
	"github.com/gpudra/gpudra/devcluster/engine"
	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/devcluster/noderuntime"
)

// Suite is one engine's e2e suite.
type Suite struct {
	// Name names the engine ("Karpenter").
	Name string
	// LogDir holds the suite's logs; LogFile is devcluster's.
	LogDir, LogFile string
}

// Begin says whether the suite runs: its binary's variable binaryEnv is
// set, or (skip) it is not and requireEnv is not either; an error where
// requireEnv asks for the binary (make test) and it is missing. It then
// sends klog to the suite's own log file.
func Begin(name, binaryEnv, requireEnv, makeTarget string) (s *Suite, skip bool, err error) {
	if os.Getenv(binaryEnv) == "" {
		if os.Getenv(requireEnv) != "" {
			return nil, false, fmt.Errorf("%s is not set: make %s builds it (make test-e2e sets it)", binaryEnv, makeTarget)
		}
		fmt.Printf("SKIP: %s's e2e tests: %s is not set (make %s; make test-e2e sets it)\n", name, binaryEnv, makeTarget)
		return nil, true, nil
	}
	dir, err := os.MkdirTemp("", "gpudra-e2e-"+makeTarget+"-logs")
	if err != nil {
		return nil, false, err
	}
	s = &Suite{Name: name, LogDir: dir, LogFile: filepath.Join(dir, "devcluster.log")}
	klogFlags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(klogFlags)
	for k, v := range map[string]string{"logtostderr": "false", "alsologtostderr": "false",
		"stderrthreshold": "FATAL", "log_file": s.LogFile, "one_output": "true", "v": "2"} {
		_ = klogFlags.Set(k, v)
	}
	return s, false, nil
}

// StartCluster starts a devcluster with no node, the chart's identities
// rendered from the repository at repo, and real containers where RUNC
// and PROBE name them.
func (s *Suite) StartCluster(ctx context.Context, repo string) (*devcluster.Cluster, error) {
	mpsControl, err := filepath.Abs(filepath.Join(repo, "hack", "fake-nvidia-cuda-mps-control"))
	if err != nil {
		return nil, err
	}
	opts := devcluster.Options{MPSControlBinary: mpsControl, Chart: chart.Default(repo)}
	if runc, probe := os.Getenv("RUNC"), os.Getenv("PROBE"); runc != "" && probe != "" {
		opts.Runtime = &noderuntime.OCIRuntime{Runc: runc, Probe: probe, MPSServer: os.Getenv("MPS_SERVER")}
	}
	c, err := devcluster.Start(ctx, opts)
	if err != nil {
		return nil, fmt.Errorf("start devcluster: %w (log: %s)", err, s.LogFile)
	}
	return c, nil
}

// AddGPUNodes adds the simulated GPU nodes, waits until each publishes its
// slices, and installs the DeviceClasses of examples/deviceclasses (the
// chart's) from examples.
func (s *Suite) AddGPUNodes(ctx context.Context, c *devcluster.Cluster, examples string, nodes ...nodeagent.NodeOptions) error {
	for _, opts := range nodes {
		n, err := c.AddNode(ctx, opts)
		if err == nil {
			err = n.WaitForSlices(ctx)
		}
		if err != nil {
			return fmt.Errorf("add node %s: %w (log: %s)", opts.Name, err, s.LogFile)
		}
	}
	if _, err := c.ApplyFiles(ctx, "", filepath.Join(examples, "deviceclasses")); err != nil {
		return fmt.Errorf("device classes: %w", err)
	}
	return nil
}

// End closes the run of code: it keeps the engines' logs with the suite's
// (the cluster's directory goes at its Stop), fails on any call an
// engine's RBAC or gpudra's chart refused, and removes the logs of a run
// that passed unless GPUDRA_E2E_KEEP_LOG is set.
func (s *Suite) End(code int, c *devcluster.Cluster, engines ...*engine.Process) int {
	klog.Flush()
	var kept []string
	for _, p := range engines {
		k := filepath.Join(s.LogDir, filepath.Base(p.Log))
		b, err := os.ReadFile(p.Log)
		if err != nil {
			continue
		}
		_ = os.WriteFile(k, b, 0o600)
		kept = append(kept, p.Name+"'s at "+k)
		// The engine runs as its own ServiceAccount: a call its RBAC lacks
		// fails the suite.
		for _, line := range engine.Forbidden(b) {
			fmt.Fprintf(os.Stderr, "FAIL: %s made a call its RBAC forbids: %s\n", p.Name, line)
			code = 1
		}
	}
	if calls := c.TakeForbidden(); len(calls) > 0 {
		fmt.Fprintln(os.Stderr, "FAIL: gpudra components made calls the chart's RBAC or admission policies forbid:")
		for _, call := range calls {
			fmt.Fprintln(os.Stderr, "  ", call)
		}
		code = 1
	}
	if code == 0 && os.Getenv("GPUDRA_E2E_KEEP_LOG") == "" {
		_ = os.RemoveAll(s.LogDir)
	} else {
		fmt.Println("devcluster log kept at", s.LogFile+"; "+strings.Join(kept, ", "))
	}
	return code
}

// Fail is a suite's exit code for err, said on stderr; 0 for nil (the
// suite was skipped).
func Fail(err error) int {
	if err == nil {
		return 0
	}
	fmt.Fprintln(os.Stderr, "FAIL:", err)
	return 1
}
