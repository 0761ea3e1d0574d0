package rayoperator

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestForbidden(t *testing.T) {
	for _, tc := range []struct {
		name string
		log  string
		want []string
	}{
		{name: "none", log: "info\tsetup\tstarting manager\ninfo\tcontrollers.RayCluster\tStarting workers\n"},
		{name: "a refused list",
			log:  "info\tok\nerror\tFailed to watch\t{\"error\": \"jobs.batch is forbidden: User \\\"system:serviceaccount:kuberay:kuberay-operator\\\" cannot list\"}\n",
			want: []string{"error\tFailed to watch\t{\"error\": \"jobs.batch is forbidden: User \\\"system:serviceaccount:kuberay:kuberay-operator\\\" cannot list\"}"}},
		{name: "the word alone is not a refusal", log: "info\tforbidden fruit\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			assert.Equal(t, tc.want, Forbidden([]byte(tc.log)))
		})
	}
}
