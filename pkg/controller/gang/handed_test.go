package gang

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	"k8s.io/client-go/kubernetes/fake"
)

// TestHandedClaims: a gang handed to kube-scheduler tells HandedOff, and
// its planned claims (with their planned allocations) are in HandedClaims
// until handedTTL, for the node hold controller.
func TestHandedClaims(t *testing.T) {
	now := t0
	handedOff := 0
	c, err := New(Options{Client: fake.NewClientset(), Dynamic: dynamicfake.NewSimpleDynamicClient(runtime.NewScheme()),
		Now: func() time.Time { return now }, HandedOff: func() { handedOff++ }})
	require.NoError(t, err)
	assert.Empty(t, c.HandedClaims())

	cl := &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "w-0"}}
	c.rememberHanded("ns/g", &Gang{Namespace: "ns", Name: "g"}, planOf(cl, "gpu-0"))
	assert.Equal(t, 1, handedOff)
	got := c.HandedClaims()
	require.Len(t, got, 1)
	assert.Equal(t, "w-0", got[0].Name)
	require.NotNil(t, got[0].Status.Allocation, "with the planned allocation")
	assert.Equal(t, "n0", got[0].Status.Allocation.Devices.Results[0].Pool)
	assert.Nil(t, cl.Status.Allocation, "the gang's own claim is not changed")

	now = now.Add(handedTTL + time.Second)
	assert.Empty(t, c.HandedClaims(), "past handedTTL")
}
