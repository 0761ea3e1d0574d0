// Package autoscaler runs Karpenter against a devcluster, as a cluster runs
// it: Karpenter's own binary (v1.15's controllers as they are, with
// devcluster's cloud provider compiled in: devcluster/karpenter, a module
// of its own on Karpenter's Kubernetes libraries) as its own process, as
// its own ServiceAccount under RBAC, against devcluster's API server, with
// its real CRDs; and devcluster's cloud (devcluster/cloud), whose machines
// are simulated GPU nodes that run the real plugin.
package autoscaler

import (
	"context"
	_ "embed"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"

	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/cloud"
	"github.com/gpudra/gpudra/devcluster/cloudapi"
	"github.com/gpudra/gpudra/devcluster/engine"
)

// BinaryEnv names the environment variable that points at the Karpenter
// binary (make karpenter builds bin/devcluster-karpenter).
const BinaryEnv = "KARPENTER"

// Namespace and ServiceAccount Karpenter runs as.
const (
	Namespace      = "karpenter"
	ServiceAccount = "karpenter"
)

//go:embed karpenter-rbac.yaml
var rbac []byte

// Options configure Karpenter's run.
type Options struct {
	// Binary is devcluster-karpenter; empty: $KARPENTER.
	Binary string
	// FeatureGates is Karpenter's --feature-gates; empty: its defaults
	// and CapacityBuffer=true.
	FeatureGates string
	// Env adds to or overrides Karpenter's environment (its options:
	// BATCH_IDLE_DURATION, LOG_LEVEL, ...).
	Env map[string]string
}

// Karpenter is a running Karpenter and the cloud it buys from.
type Karpenter struct {
	*engine.Process
	Cloud *cloud.Cloud
	// Dir holds its kubeconfig, CRDs and log.
	Dir string

	cancel context.CancelFunc
}

// GVRs of Karpenter's objects, for tests and the demo.
var (
	NodePools    = schema.GroupVersionResource{Group: "karpenter.sh", Version: "v1", Resource: "nodepools"}
	NodeClaims   = schema.GroupVersionResource{Group: "karpenter.sh", Version: "v1", Resource: "nodeclaims"}
	NodeClasses  = schema.GroupVersionResource{Group: "karpenter.devcluster.gpudra.dev", Version: "v1alpha1", Resource: "gpunodeclasses"}
	CapacityBufs = schema.GroupVersionResource{Group: "autoscaling.x-k8s.io", Version: "v1beta1", Resource: "capacitybuffers"}
)

// Start installs Karpenter's CRDs and identity, starts the cloud, and
// runs Karpenter until Stop, waiting until it reports ready.
func Start(ctx context.Context, c *devcluster.Cluster, opts Options) (_ *Karpenter, err error) {
	if opts.Binary == "" {
		opts.Binary = os.Getenv(BinaryEnv)
	}
	if opts.Binary == "" {
		return nil, fmt.Errorf("no Karpenter binary: set %s (make karpenter builds bin/devcluster-karpenter)", BinaryEnv)
	}
	dir := filepath.Join(c.Dir, "karpenter")
	crds, err := exec.CommandContext(ctx, opts.Binary, "crds").Output()
	if err != nil {
		return nil, fmt.Errorf("%s crds: %w", opts.Binary, err)
	}
	var manifests []string
	for _, m := range []struct {
		name    string
		content []byte
	}{{"crds.yaml", crds}, {"rbac.yaml", rbac}} {
		path, err := engine.WriteManifest(dir, m.name, m.content)
		if err != nil {
			return nil, err
		}
		manifests = append(manifests, path)
	}
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer func() {
		if err != nil {
			cancel()
		}
	}()
	cl, err := cloud.Start(runCtx, filepath.Join(dir, "cloud.sock"), c)
	if err != nil {
		return nil, err
	}
	ports, err := engine.FreePorts(2)
	if err != nil {
		return nil, err
	}
	env := map[string]string{
		cloudapi.SocketEnv: cl.Socket, "SYSTEM_NAMESPACE": Namespace,
		// Its DRA simulation: ResourceClaims decide which type fits.
		"IGNORE_DRA_REQUESTS": "false",
		// One replica: no lease to wait for.
		"DISABLE_LEADER_ELECTION": "true",
		"METRICS_PORT":            strconv.Itoa(ports[0]), "HEALTH_PROBE_PORT": strconv.Itoa(ports[1]),
		"FEATURE_GATES": "CapacityBuffer=true",
		"LOG_LEVEL":     "debug",
	}
	if opts.FeatureGates != "" {
		env["FEATURE_GATES"] = opts.FeatureGates
	}
	for k, v := range opts.Env {
		env[k] = v
	}
	p, err := engine.Start(ctx, c, engine.Spec{Name: "Karpenter", Dir: dir, Binary: opts.Binary, Env: env,
		Manifests: manifests, Served: []schema.GroupVersionResource{NodePools, NodeClaims, NodeClasses, CapacityBufs},
		Namespace: Namespace, ServiceAccount: ServiceAccount, ReadyURL: "http://127.0.0.1:" + strconv.Itoa(ports[1]) + "/readyz"})
	if err != nil {
		return nil, err
	}
	return &Karpenter{Process: p, Cloud: cl, Dir: dir, cancel: cancel}, nil
}

// Stop stops Karpenter and the cloud. The machines it bought stay until
// the cluster stops.
func (k *Karpenter) Stop() {
	k.Process.Stop()
	k.cancel()
}
