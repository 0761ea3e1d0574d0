package prepbench_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/watch"

	"github.com/gpudra/gpudra/bench/prepbench"
	"github.com/gpudra/gpudra/devcluster"
	"github.com/gpudra/gpudra/devcluster/chart"
)

// TestHarnessPreparesAFewClaims runs make bench-prepare's harness on 3
// claims over 2 GPUs (so that two claims take turns on one GPU, as 200
// claims over 8 do) against a control plane that runs the controllers a
// cluster runs (the ResourceClaim controller, gpudra-controller). Every
// claim must be prepared and unprepared, and a watch over the run checks
// what the harness did to the cluster: no device allocated to two claims
// at once (the state the cluster's controllers repair, which once stopped
// make bench-prepare at its first claim: "claim default/bench-000 not
// allocated"), each claim allocated once and released after its
// unprepare. A few seconds; skipped with -short.
func TestHarnessPreparesAFewClaims(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a control plane and the plugin")
	}
	bin := t.TempDir()
	// The plugin of this tree, as the scale benchmark's test builds it.
	plugin := filepath.Join(bin, "gpudra-kubelet-plugin")
	cmd := exec.Command("go", "build", "-o", plugin, "./cmd/kubelet-plugin")
	cmd.Dir = "../.."
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "go build: %s", out)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cluster, err := devcluster.Start(ctx, devcluster.Options{Chart: chart.Default("../..")})
	require.NoError(t, err)
	defer cluster.Stop()
	const node = "prepbench-test"
	w, err := cluster.Client.ResourceV1().ResourceClaims(metav1.NamespaceDefault).Watch(ctx, metav1.ListOptions{LabelSelector: "prepbench.gpudra.dev/node=" + node})
	require.NoError(t, err)
	seen := watchAllocations(t, w)

	res, err := prepbench.Run(ctx, prepbench.Config{PluginBinary: plugin, Claims: 3, Devices: 2, Machine: "dgx-h100-nomig",
		Cluster: cluster, Node: node, Dir: t.TempDir()})
	require.NoError(t, err)
	require.Len(t, res.Prepare, 3)
	require.Len(t, res.Unprepare, 3)
	for i := range res.Prepare {
		assert.Positive(t, res.Prepare[i], "prepare %d", i)
		assert.Positive(t, res.Unprepare[i], "unprepare %d", i)
	}
	assert.Positive(t, res.PeakRSS)

	w.Stop()
	a := seen()
	assert.Empty(t, a.twice, "devices allocated to two claims at once")
	assert.Equal(t, map[string][]string{
		node + "-000": {"gpu-0", ""}, node + "-001": {"gpu-1", ""}, node + "-002": {"gpu-0", ""},
	}, a.history, "each claim allocated to its GPU once, then released")
}

// allocations is what a watch saw of the claims' allocations.
type allocations struct {
	// history: claim -> its device after each change of it ("": not
	// allocated), repeats left out.
	history map[string][]string
	// twice: "<device> held by <claim> and <claim>", each time it was.
	twice []string
}

// watchAllocations follows the claims' allocations until w stops; the
// function it returns waits for that and says what it saw.
func watchAllocations(t *testing.T, w watch.Interface) func() allocations {
	t.Helper()
	var (
		mu   sync.Mutex
		a    = allocations{history: map[string][]string{}}
		done = make(chan struct{})
	)
	go func() {
		defer close(done)
		holder := map[string]string{} // claim -> device it holds now
		for ev := range w.ResultChan() {
			c, ok := ev.Object.(*resourceapi.ResourceClaim)
			if !ok || ev.Type == watch.Deleted {
				continue
			}
			device := ""
			if c.Status.Allocation != nil && len(c.Status.Allocation.Devices.Results) > 0 {
				device = c.Status.Allocation.Devices.Results[0].Device
			}
			mu.Lock()
			if h := a.history[c.Name]; len(h) == 0 || h[len(h)-1] != device {
				if len(h) > 0 || device != "" {
					a.history[c.Name] = append(h, device)
				}
			}
			holder[c.Name] = device
			for other, d := range holder {
				if other != c.Name && device != "" && d == device {
					a.twice = append(a.twice, device+" held by "+c.Name+" and "+other)
				}
			}
			mu.Unlock()
		}
	}()
	return func() allocations {
		<-done
		mu.Lock()
		defer mu.Unlock()
		return a
	}
}
