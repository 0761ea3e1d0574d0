package e2e

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	appsv1 "k8s.io/api/apps/v1"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/component-helpers/scheduling/corev1/nodeaffinity"
)

// TestChartOneModePerNode: with the chart's per-node mode, exactly one of
// its two DaemonSets runs on each GPU node, chosen by the node's label
// gpu.gpudra.dev/mode and, without it, by kubeletPlugin.mode; a node that
// the chart's own affinity excludes runs neither. The DaemonSets' required
// node affinity is evaluated as the DaemonSet controller and the scheduler
// evaluate it.
func TestChartOneModePerNode(t *testing.T) {
	gpuNode := map[string]string{"nvidia.com/gpu.present": "true"}
	with := func(extra map[string]string) map[string]string {
		l := map[string]string{}
		for k, v := range gpuNode {
			l[k] = v
		}
		for k, v := range extra {
			l[k] = v
		}
		return l
	}
	for _, tc := range []struct {
		name   string
		values []string
		nodes  map[string]map[string]string // by name, the node's labels
		want   map[string]string            // by name, the DaemonSet that runs there ("" none)
	}{
		{"default mode dra", nil,
			map[string]map[string]string{"unlabelled": with(nil), "dra": with(map[string]string{"gpu.gpudra.dev/mode": "dra"}),
				"device-plugin": with(map[string]string{"gpu.gpudra.dev/mode": "device-plugin"}), "no GPU": {"gpu.gpudra.dev/mode": "device-plugin"}},
			map[string]string{"unlabelled": "gpudra-chart-kubelet-plugin", "dra": "gpudra-chart-kubelet-plugin",
				"device-plugin": "gpudra-chart-device-plugin", "no GPU": ""}},
		{"default mode device-plugin", []string{"--set", "kubeletPlugin.mode=device-plugin"},
			map[string]map[string]string{"unlabelled": with(nil), "dra": with(map[string]string{"gpu.gpudra.dev/mode": "dra"}),
				"device-plugin": with(map[string]string{"gpu.gpudra.dev/mode": "device-plugin"})},
			map[string]string{"unlabelled": "gpudra-chart-device-plugin", "dra": "gpudra-chart-kubelet-plugin",
				"device-plugin": "gpudra-chart-device-plugin"}},
		{"per-node mode off", []string{"--set", "kubeletPlugin.perNodeMode=false"},
			map[string]map[string]string{"unlabelled": with(nil), "device-plugin": with(map[string]string{"gpu.gpudra.dev/mode": "device-plugin"})},
			map[string]string{"unlabelled": "gpudra-chart-kubelet-plugin", "device-plugin": "gpudra-chart-kubelet-plugin"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out, err := render(t, tc.values...)
			require.NoError(t, err, out)
			var daemonSets []appsv1.DaemonSet
			for _, o := range objectsFrom(t, out) {
				if o.GetKind() == "DaemonSet" {
					var ds appsv1.DaemonSet
					require.NoError(t, runtimeConvert(o, &ds))
					daemonSets = append(daemonSets, ds)
				}
			}
			require.NotEmpty(t, daemonSets)
			for node, labels := range tc.nodes {
				n := &v1.Node{ObjectMeta: metav1.ObjectMeta{Name: node, Labels: labels}}
				var runs []string
				for _, ds := range daemonSets {
					ok, err := nodeaffinity.GetRequiredNodeAffinity(&v1.Pod{Spec: ds.Spec.Template.Spec}).Match(n)
					require.NoError(t, err)
					if ok {
						runs = append(runs, ds.Name)
					}
				}
				if tc.want[node] == "" {
					assert.Empty(t, runs, "node %s", node)
				} else {
					assert.Equal(t, []string{tc.want[node]}, runs, "node %s", node)
				}
			}
		})
	}
}
