package devcluster

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"path/filepath"
	"slices"
	"time"

	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/client-go/util/retry"

	"github.com/gpudra/gpudra/devcluster/controlplane"
	"github.com/gpudra/gpudra/devcluster/realnode"
)

// RealNodeOptions describe a node run by the kubelet binary and containerd
// (package realnode) beside the simulated ones.
type RealNodeOptions struct {
	Name     string
	Binaries realnode.Binaries
}

// AddRealNode starts a real node and waits until its kubelet has
// registered the Node and reports it Ready. The kubelet authenticates with
// a client certificate for system:node:<name> (group system:nodes) from
// the cluster's client CA (Options.RealNodes), so the Node authorizer and
// NodeRestriction hold it as they hold any kubelet.
func (c *Cluster) AddRealNode(ctx context.Context, opts RealNodeOptions) (*realnode.Node, error) {
	if c.clientCA == nil {
		return nil, errors.New("real nodes need Options.RealNodes: the API server trusts devcluster's node client CA only then")
	}
	c.mu.Lock()
	if _, dup := c.nodes[opts.Name]; dup || c.realNodes[opts.Name] != nil {
		c.mu.Unlock()
		return nil, fmt.Errorf("node %q exists already", opts.Name)
	}
	index := len(c.realNodes)
	c.mu.Unlock()
	cert, key, err := c.clientCA.Issue("system:node:"+opts.Name, "system:nodes")
	if err != nil {
		return nil, err
	}
	u, err := url.Parse(c.RESTConfig.Host)
	if err != nil {
		return nil, err
	}
	ca, err := controlplane.ServingCA(u.Host)
	if err != nil {
		return nil, err
	}
	dir := filepath.Join(c.Dir, "r", opts.Name)
	n, err := realnode.Start(ctx, realnode.Options{Name: opts.Name, Dir: dir, Binaries: opts.Binaries,
		APIServer: c.RESTConfig.Host, CA: ca, Cert: cert, Key: key,
		CDIDirs: []string{filepath.Join(dir, "cdi")}, PodSubnet: fmt.Sprintf("10.244.%d.0/24", index)})
	if err != nil {
		return nil, err
	}
	c.mu.Lock()
	c.realNodes[opts.Name] = n
	c.mu.Unlock()
	err = wait.PollUntilContextTimeout(ctx, 200*time.Millisecond, 2*time.Minute, true, func(ctx context.Context) (bool, error) {
		node, err := c.Client.CoreV1().Nodes().Get(ctx, opts.Name, metav1.GetOptions{})
		if err != nil {
			return false, nil
		}
		for _, cond := range node.Status.Conditions {
			if cond.Type == v1.NodeReady {
				return cond.Status == v1.ConditionTrue, nil
			}
		}
		return false, nil
	})
	if err != nil {
		return n, fmt.Errorf("real node %s is not Ready (kubelet log: %s): %w", opts.Name, filepath.Join(dir, "kubelet.log"), err)
	}
	// Admission taints a new Node not-ready, and no node lifecycle
	// controller runs here to lift it (it would also judge the simulated
	// nodes, whose stand-in kubelet sends no heartbeats): devcluster lifts
	// it once the kubelet reports Ready, as that controller does.
	err = retry.RetryOnConflict(retry.DefaultRetry, func() error {
		node, err := c.Client.CoreV1().Nodes().Get(ctx, opts.Name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		taints := slices.DeleteFunc(slices.Clone(node.Spec.Taints), func(t v1.Taint) bool { return t.Key == v1.TaintNodeNotReady })
		if len(taints) == len(node.Spec.Taints) {
			return nil
		}
		node.Spec.Taints = taints
		_, err = c.Client.CoreV1().Nodes().Update(ctx, node, metav1.UpdateOptions{})
		return err
	})
	if err != nil {
		return n, fmt.Errorf("real node %s: lift the not-ready taint: %w", opts.Name, err)
	}
	return n, nil
}
