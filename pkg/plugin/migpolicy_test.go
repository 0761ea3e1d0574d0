package plugin

import (
	"testing"

	"github.com/stretchr/testify/assert"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/klog/v2/ktesting"

	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// TestNodeMigPolicy: the Node's annotation overrides --mig-devices; one
// that does not parse, or a Node that cannot be read, leaves the flag's.
func TestNodeMigPolicy(t *testing.T) {
	flag := slicebuilder.MigPolicy{Existing: true}
	node := func(annotations map[string]string) *corev1.Node {
		return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "n", Annotations: annotations}}
	}
	tests := []struct {
		name string
		node *corev1.Node
		want slicebuilder.MigPolicy
	}{
		{"no annotation", node(nil), flag},
		{"annotation", node(map[string]string{AnnotationMigDevices: "profiles=3g.40gb"}), slicebuilder.MigPolicy{Profiles: []string{"3g.40gb"}}},
		{"all on one node", node(map[string]string{AnnotationMigDevices: "all"}), slicebuilder.MigPolicy{}},
		{"invalid: the flag's", node(map[string]string{AnnotationMigDevices: "many"}), flag},
		{"no Node: the flag's", nil, flag},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, ctx := ktesting.NewTestContext(t)
			client := fake.NewClientset()
			if tt.node != nil {
				client = fake.NewClientset(tt.node)
			}
			assert.Equal(t, tt.want, nodeMigPolicy(ctx, client, "n", flag, nil))
		})
	}
}
