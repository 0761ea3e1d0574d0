// Package kueue_test runs Kueue's real manager (v0.17, devcluster/kueue)
// in front of gpudra on a devcluster with a simulated DGX H100: two teams'
// ClusterQueues in a cohort with a quota of gpudra's GPUs, jobs admitted by
// Kueue and placed by gpudra and kube-scheduler, and the rules of
// docs/queues.md (which queue holds a job when both are installed).
package kueue_test

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/util/version"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/e2e/enginesuite"
	"github.com/gpudra/gpudra/devcluster/kueuemanager"
	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/devcluster/rayoperator"
)

// node is the one GPU node: 8 H100 with MIG off.
const node = "dgx-h100-0"

var (
	cluster  *devcluster.Cluster
	manager  *kueuemanager.Manager
	operator *rayoperator.Operator
	examples = filepath.Join("..", "..", "..", "examples")
)

func TestMain(m *testing.M) {
	flag.Parse()
	os.Exit(run(m))
}

func run(m *testing.M) int {
	suite, skip, err := enginesuite.Begin("Kueue", kueuemanager.BinaryEnv, "GPUDRA_REQUIRE_KUEUE", "kueue")
	if skip || err != nil {
		return enginesuite.Fail(err)
	}
	ctx := context.Background()
	start := time.Now()
	if cluster, err = suite.StartCluster(ctx, filepath.Join("..", "..", "..")); err != nil {
		return enginesuite.Fail(err)
	}
	defer cluster.Stop()
	// Kueue parses the API server's version and refuses to start without
	// one: a control plane built without Kubernetes' version stamped
	// (make test-e2e stamps it) says so here, not in Kueue's log.
	info, err := cluster.Client.Discovery().ServerVersion()
	if err == nil {
		_, err = version.ParseSemantic(info.GitVersion)
	}
	if err != nil {
		return enginesuite.Fail(fmt.Errorf("the API server's version, which Kueue needs: %w (build the tests with -ldflags \"$(KUBE_LDFLAGS)\" of the Makefile, as make test-e2e does)", err))
	}
	if err := suite.AddGPUNodes(ctx, cluster, examples, nodeagent.NodeOptions{Name: node, Machine: "dgx-h100-nomig"}); err != nil {
		return enginesuite.Fail(err)
	}
	// A short waitForPodsReady: TestAdmittedGangThatCannotBePlacedGivesQuotaBack
	// waits for it.
	if manager, err = kueuemanager.Start(ctx, cluster, kueuemanager.Options{PodsReadyTimeout: podsReadyTimeout}); err != nil {
		return enginesuite.Fail(fmt.Errorf("start Kueue: %w (log: %s)", err, suite.LogFile))
	}
	defer manager.Stop()
	if _, err := cluster.ApplyFiles(ctx, "", filepath.Join(examples, "kueue")); err != nil {
		return enginesuite.Fail(fmt.Errorf("examples/kueue: %w", err))
	}
	// KubeRay beside Kueue: RayJobs admitted by Kueue (its ray.io/rayjob
	// integration), made by KubeRay, placed by gpudra.
	if os.Getenv(rayoperator.BinaryEnv) == "" {
		return enginesuite.Fail(fmt.Errorf("%s is not set: Kueue's suite runs KubeRay's operator too (make kuberay)", rayoperator.BinaryEnv))
	}
	if operator, err = rayoperator.Start(ctx, cluster, rayoperator.Options{}); err != nil {
		return enginesuite.Fail(fmt.Errorf("start KubeRay's operator: %w (log: %s)", err, suite.LogFile))
	}
	defer operator.Stop()
	if _, err := cluster.ApplyFiles(ctx, "", filepath.Join(examples, "ray", "edit-rayjobs.yaml")); err != nil {
		return enginesuite.Fail(fmt.Errorf("examples/ray/edit-rayjobs.yaml: %w", err))
	}
	fmt.Printf("devcluster with a simulated DGX H100, Kueue and KubeRay's operator ready in %s; logs: %s, %s, %s\n",
		time.Since(start).Round(time.Millisecond), suite.LogFile, manager.Log, operator.Log)
	return suite.End(m.Run(), cluster, manager.Process, operator.Process)
}
