package sim

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// TestHost: the simulated majors, and the machine itself as the compute
// policy.
func TestHost(t *testing.T) {
	m, err := NewBuiltin("dgx-h100", "node-a")
	require.NoError(t, err)
	host, err := m.Host(context.Background())
	require.NoError(t, err)
	assert.Equal(t, nvdevice.DeviceMajors{NVIDIA: 195, UVM: 508, Caps: 511}, host.Majors)

	require.NotNil(t, host.ComputePolicy, "the simulator can time-slice")
	gpu := inventory(t, m).GPUs[3].UUID
	require.NoError(t, host.ComputePolicy.SetTimeSlice(context.Background(), gpu, 2))
	assert.Equal(t, 2, m.TimeSlice(gpu), "the policy is the machine's own")
	require.ErrorIs(t, host.ComputePolicy.SetTimeSlice(context.Background(), "GPU-none", 1), nvdevice.ErrNotFound)
}
