package e2e

import (
	"context"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/clientcmd"
)

// The kubeconfig the demo writes is what kubectl would load: a client built
// from it alone reaches the API server and sees the simulated nodes.
func TestKubeconfigReachesTheCluster(t *testing.T) {
	dir, err := os.MkdirTemp("", "kubeconfig")
	require.NoError(t, err)
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "config")
	require.NoError(t, cluster.WriteKubeconfig(path))

	cfg, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(
		&clientcmd.ClientConfigLoadingRules{ExplicitPath: path}, &clientcmd.ConfigOverrides{}).ClientConfig()
	require.NoError(t, err)
	client, err := kubernetes.NewForConfig(cfg)
	require.NoError(t, err)
	nodes, err := client.CoreV1().Nodes().List(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	var names []string
	for _, n := range nodes.Items {
		names = append(names, n.Name)
	}
	assert.Subset(t, names, []string{"dgx-h100-0", "dgx-h100-1"})
	slices, err := client.ResourceV1().ResourceSlices().List(context.Background(), metav1.ListOptions{})
	require.NoError(t, err)
	assert.NotEmpty(t, slices.Items)
}
