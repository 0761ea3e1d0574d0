package grove

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

// A user who may not list nodes and slices still sees the groups, with the
// node from the allocation's selector.
func TestListGroupsWithoutNodesAndSlices(t *testing.T) {
	primary := consumer("primary", boundTo("node-a"))
	notOurs := groveClaim(allocated("node-a"))
	notOurs.Name = "theirs"
	notOurs.Status.Allocation.Devices.Results[0].Driver = "gpu.nvidia.com"
	client := fake.NewClientset(groveClaim(allocated("node-a"), reservedFor(primary)), notOurs, primary, node("node-a", nil))
	for _, resource := range []string{"nodes", "resourceslices"} {
		client.PrependReactor("list", resource, func(k8stesting.Action) (bool, runtime.Object, error) {
			return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: resource}, "", nil)
		})
	}
	groups, err := ListGroups(context.Background(), client, "", t0)
	require.NoError(t, err)
	require.Len(t, groups, 1)
	assert.Equal(t, "node-a", groups[0].Node)
	assert.Equal(t, []Device{{Request: "gpu", Pool: "node-a", Device: "gpu-0"}}, groups[0].Devices)
	assert.Equal(t, []Consumer{{Name: "primary", UID: "primary-uid", Node: "node-a", Phase: "Running", Reserved: true}}, groups[0].Consumers)
}
