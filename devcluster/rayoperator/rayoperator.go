// Package rayoperator runs KubeRay's operator against a devcluster, as a
// cluster runs it: KubeRay's own binary (v1.5's ray-operator main package
// as released, built from devcluster/kuberay, a module of its own at
// KubeRay's dependency versions) as its own process, as its own
// ServiceAccount under RBAC, against devcluster's API server, with the
// CRDs of that version (docs/ray.md).
package rayoperator

import (
	"context"
	_ "embed"
	"fmt"
	"os"
	"path/filepath"
	"strconv"

	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/engine"
	"github.com/gpudra/gpudra/pkg/kuberay"
)

// BinaryEnv names the environment variable that points at KubeRay's
// operator binary (make kuberay builds bin/kuberay/kuberay-operator).
const BinaryEnv = "KUBERAY"

// CRDsFile is the name of the CRDs of the binary's version, beside it:
// the binary cannot print them, and the Go module cache they come from is
// not there at run time, so make kuberay writes them there at build time.
const CRDsFile = "crds.yaml"

// Namespace and ServiceAccount the operator runs as.
const (
	Namespace      = "kuberay"
	ServiceAccount = "kuberay-operator"
)

//go:embed kuberay-rbac.yaml
var rbac []byte

// GVRs of KubeRay's objects, for tests and the demo.
var (
	RayClusters = kuberay.RayClusters
	RayJobs     = kuberay.RayJobs
	RayServices = kuberay.RayServices
)

// Options configure the operator's run.
type Options struct {
	// Binary is kuberay-operator; empty: $KUBERAY. Its CRDs are
	// CRDsFile beside it.
	Binary string
	// Args add to the operator's flags (--feature-gates, ...).
	Args []string
	// Env adds to the operator's environment.
	Env map[string]string
}

// Operator is a running KubeRay operator.
type Operator struct {
	*engine.Process
	// Dir holds its kubeconfig, RBAC and log.
	Dir string
}

// Start installs KubeRay's CRDs and the operator's identity, and runs the
// operator until Stop, waiting until it reports ready.
func Start(ctx context.Context, c *devcluster.Cluster, opts Options) (*Operator, error) {
	if opts.Binary == "" {
		opts.Binary = os.Getenv(BinaryEnv)
	}
	if opts.Binary == "" {
		return nil, fmt.Errorf("no KubeRay operator binary: set %s (make kuberay builds bin/kuberay/kuberay-operator)", BinaryEnv)
	}
	crds := filepath.Join(filepath.Dir(opts.Binary), CRDsFile)
	if _, err := os.Stat(crds); err != nil {
		return nil, fmt.Errorf("KubeRay's CRDs, %s beside %s (make kuberay writes them): %w", CRDsFile, opts.Binary, err)
	}
	dir := filepath.Join(c.Dir, "kuberay")
	rbacFile, err := engine.WriteManifest(dir, "rbac.yaml", rbac)
	if err != nil {
		return nil, err
	}
	ports, err := engine.FreePorts(2)
	if err != nil {
		return nil, err
	}
	args := []string{
		"--metrics-addr=127.0.0.1:" + strconv.Itoa(ports[0]),
		"--health-probe-bind-address=127.0.0.1:" + strconv.Itoa(ports[1]),
		// One replica: no lease to wait for.
		"--enable-leader-election=false",
		"--log-stdout-encoder=console",
	}
	p, err := engine.Start(ctx, c, engine.Spec{Name: "KubeRay's operator", Dir: dir, Binary: opts.Binary,
		Args: append(args, opts.Args...), Env: opts.Env, Manifests: []string{crds, rbacFile},
		Served: []schema.GroupVersionResource{RayClusters, RayJobs, RayServices}, Namespace: Namespace, ServiceAccount: ServiceAccount,
		ReadyURL: "http://127.0.0.1:" + strconv.Itoa(ports[1]) + "/readyz"})
	if err != nil {
		return nil, err
	}
	return &Operator{Process: p, Dir: dir}, nil
}

// Forbidden are the lines of the operator's log where the API server
// refused it a call: its RBAC (kuberay-rbac.yaml) lacks what it does.
func Forbidden(log []byte) []string { return engine.Forbidden(log) }
