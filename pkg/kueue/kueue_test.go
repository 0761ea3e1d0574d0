package kueue

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"sigs.k8s.io/yaml"
)

// TestKueueStates: each Kueue condition set reads as one state, and only
// a workload that is not admitted carries a reason.
func TestKueueStates(t *testing.T) {
	for name, tc := range map[string]struct {
		conditions, extra string
		state, reason     string
	}{
		"no condition yet":         {state: Pending},
		"quota reserved, checking": {conditions: `[{type: QuotaReserved, status: "True", reason: QuotaReserved}]`, state: Reserved},
		"finished":                 {conditions: `[{type: Admitted, status: "True"}, {type: Finished, status: "True", reason: Succeeded}]`, state: Finished},
		"evicted, back in line":    {conditions: `[{type: Evicted, status: "True", reason: Preempted, message: "Preempted to accommodate a workload"}]`, state: Pending, reason: "Preempted"},
		"deactivated":              {extra: "spec: {active: false}", state: Inactive},
	} {
		t.Run(name, func(t *testing.T) {
			y := "apiVersion: kueue.x-k8s.io/v1beta2\nkind: Workload\nmetadata: {name: w, namespace: ns}\n"
			if tc.extra != "" {
				y += tc.extra + "\n"
			}
			if tc.conditions != "" {
				y += "status: {conditions: " + tc.conditions + "}\n"
			}
			u := &unstructured.Unstructured{}
			require.NoError(t, yaml.Unmarshal([]byte(y), &u.Object))
			ks := StatusOf(u, nil)
			assert.Equal(t, tc.state, ks.State)
			assert.Equal(t, tc.reason, ks.Reason)
		})
	}
}
