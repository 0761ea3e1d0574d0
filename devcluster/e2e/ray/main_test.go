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

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/e2e/enginesuite"
	"github.com/gpudra/gpudra/devcluster/nodeagent"
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
	suite, skip, err := enginesuite.Begin("KubeRay's operator", rayoperator.BinaryEnv, "GPUDRA_REQUIRE_KUBERAY", "kuberay")
	if skip || err != nil {
		return enginesuite.Fail(err)
	}
	ctx := context.Background()
	start := time.Now()
	if cluster, err = suite.StartCluster(ctx, filepath.Join("..", "..", "..")); err != nil {
		return enginesuite.Fail(err)
	}
	defer cluster.Stop()
	nodes := []nodeagent.NodeOptions{{Name: migNode, Machine: "dgx-h100"},
		{Name: "dgx-h100-1", Machine: "dgx-h100-nomig"}, {Name: "dgx-h100-2", Machine: "dgx-h100-nomig"},
		nodeagent.FractionalNode(fractionalNode, filepath.Join(examples, "machines", "one-h100.yaml"))}
	if err := suite.AddGPUNodes(ctx, cluster, examples, nodes...); err != nil {
		return enginesuite.Fail(err)
	}
	if operator, err = rayoperator.Start(ctx, cluster, rayoperator.Options{}); err != nil {
		return enginesuite.Fail(fmt.Errorf("start KubeRay's operator: %w (log: %s)", err, suite.LogFile))
	}
	defer operator.Stop()
	fmt.Printf("devcluster with 3 simulated DGX H100 nodes, a fractional H100 and KubeRay's operator ready in %s; logs: %s, %s\n",
		time.Since(start).Round(time.Millisecond), suite.LogFile, operator.Log)
	return suite.End(m.Run(), cluster, operator.Process)
}
