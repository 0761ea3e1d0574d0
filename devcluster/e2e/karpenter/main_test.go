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

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/autoscaler"
	"github.com/gpudra/gpudra/devcluster/e2e/enginesuite"
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
	suite, skip, err := enginesuite.Begin("Karpenter", autoscaler.BinaryEnv, "GPUDRA_REQUIRE_KARPENTER", "karpenter")
	if skip || err != nil {
		return enginesuite.Fail(err)
	}
	ctx := context.Background()
	start := time.Now()
	if cluster, err = suite.StartCluster(ctx, filepath.Join("..", "..", "..")); err != nil {
		return enginesuite.Fail(err)
	}
	defer cluster.Stop()
	if _, err := cluster.ApplyFiles(ctx, "", filepath.Join(examples, "deviceclasses")); err != nil {
		return enginesuite.Fail(fmt.Errorf("device classes: %w", err))
	}
	if karpenter, err = autoscaler.Start(ctx, cluster, autoscaler.Options{}); err != nil {
		return enginesuite.Fail(fmt.Errorf("start Karpenter: %w (log: %s)", err, suite.LogFile))
	}
	defer karpenter.Stop()
	if _, err := cluster.ApplyFiles(ctx, "", filepath.Join(examples, "autoscaling", "nodeclasses.yaml"), filepath.Join(examples, "autoscaling", "nodepools.yaml")); err != nil {
		return enginesuite.Fail(fmt.Errorf("examples/autoscaling: %w", err))
	}
	fmt.Printf("devcluster with no GPU node and Karpenter ready in %s; logs: %s, %s\n", time.Since(start).Round(time.Millisecond), suite.LogFile, karpenter.Log)
	return suite.End(m.Run(), cluster, karpenter.Process)
}
