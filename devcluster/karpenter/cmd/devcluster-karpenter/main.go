// Command devcluster-karpenter is Karpenter, v1.15's controllers as they
// are, with devcluster's cloud provider compiled in, as a cloud's Karpenter
// binary is. It runs as its own process against devcluster's API server
// (KUBECONFIG), buying machines from devcluster's cloud on the socket
// $DEVCLUSTER_CLOUD_SOCKET. Karpenter's own options come from its flags and
// environment (IGNORE_DRA_REQUESTS=false turns its DRA simulation on).
//
// `devcluster-karpenter crds` prints the CRDs it needs: Karpenter's, and
// GPUNodeClass.
package main

import (
	"fmt"
	"os"

	"github.com/samber/lo"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/client-go/kubernetes/scheme"
	"sigs.k8s.io/controller-runtime/pkg/log"
	"sigs.k8s.io/karpenter/pkg/apis"
	"sigs.k8s.io/karpenter/pkg/controllers"
	"sigs.k8s.io/karpenter/pkg/controllers/node/health"
	"sigs.k8s.io/karpenter/pkg/controllers/state"
	"sigs.k8s.io/karpenter/pkg/operator"
	"sigs.k8s.io/yaml"

	"github.com/gpudra/gpudra/devcluster/cloudapi"
	"github.com/gpudra/gpudra/devcluster/karpenter/crds"
	"github.com/gpudra/gpudra/devcluster/karpenter/provider"
)

func main() {
	if len(os.Args) == 2 && os.Args[1] == "crds" {
		if err := printCRDs(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		return
	}
	socket := os.Getenv(cloudapi.SocketEnv)
	if socket == "" {
		fmt.Fprintf(os.Stderr, "devcluster-karpenter: %s is not set: the devcluster cloud's socket\n", cloudapi.SocketEnv)
		os.Exit(2)
	}
	lo.Must0(provider.AddToScheme(scheme.Scheme))
	ctx, op := operator.NewOperator()
	cloudProvider := provider.New(op.GetClient(), provider.NewCloudClient(socket))
	repairPolicies, err := health.NewRepairPolicyMatcher(ctx, cloudProvider)
	if err != nil {
		log.FromContext(ctx).Error(err, "repair policies")
		os.Exit(1)
	}
	clusterState := state.NewCluster(op.Clock, op.GetClient(), cloudProvider, state.WithRepairPolicyMatcher(repairPolicies))
	op.WithControllers(ctx, controllers.NewControllers(ctx, op.Manager, op.Clock, op.GetClient(), op.EventRecorder,
		cloudProvider, cloudProvider, clusterState, op.InstanceTypeStore, op.PredictionStore)...).Start(ctx)
}

// printCRDs writes Karpenter's CRDs and GPUNodeClass's as one YAML stream.
func printCRDs() error {
	for _, crd := range apis.CRDs {
		out, err := yaml.Marshal(crd)
		if err != nil {
			return err
		}
		fmt.Printf("---\n%s", out)
	}
	var nodeClass apiextensionsv1.CustomResourceDefinition
	if err := yaml.UnmarshalStrict(crds.GPUNodeClass, &nodeClass); err != nil {
		return fmt.Errorf("the GPUNodeClass CRD: %w", err)
	}
	fmt.Printf("---\n%s", crds.GPUNodeClass)
	return nil
}
