package plugin

import (
	"context"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/prepared"
)

// names lists each claim as uid:namespace/name:devices.
func names(cs []prepared.Claim) []string {
	var out []string
	for _, c := range cs {
		s := c.UID + ":" + c.Ref() + ":"
		for _, d := range c.Devices {
			s += d.Device + ","
		}
		out = append(out, s)
	}
	return out
}

func TestPreparedClaims(t *testing.T) {
	e := newEnv(t)
	s := e.start()
	assert.Empty(t, s.PreparedClaims(), "nothing prepared yet")
	_, err := prep(s, claim("u2", []string{"gpu-3"}))
	require.NoError(t, err)
	_, err = prep(s, claim("u1", []string{"gpu-0-mig-3g-40gb-4"}))
	require.NoError(t, err)
	got := s.PreparedClaims()
	assert.Equal(t, []string{"u1:ns/claim-u1:gpu-0-mig-3g-40gb-4,", "u2:ns/claim-u2:gpu-3,"}, names(got), "sorted by UID, with namespace and name")
	inv, err := e.machine.Inventory(context.Background())
	require.NoError(t, err)
	assert.Equal(t, inv.GPUs[0].UUID, got[0].Devices[0].GPUUUID, "a MIG device's parent GPU")
	assert.True(t, got[0].Devices[0].Mig)
	assert.Nil(t, got[0].Devices[0].CreatedMig, "no record a copy would share")

	// The copy is the caller's.
	got[0].Name = "changed"
	got[1].Devices[0].Device = "gpu-7"
	got[1] = prepared.Claim{UID: "u9"}
	assert.Equal(t, []string{"u1:ns/claim-u1:gpu-0-mig-3g-40gb-4,", "u2:ns/claim-u2:gpu-3,"}, names(s.PreparedClaims()), "changing a copy changes nothing")

	_, err = s.Unprepare(context.Background(), "u2")
	require.NoError(t, err)
	assert.Equal(t, []string{"u1:ns/claim-u1:gpu-0-mig-3g-40gb-4,"}, names(s.PreparedClaims()), "an unprepared claim is gone")

	// A restart (another instance) reads the same claims from the checkpoint.
	require.NoError(t, s.Close())
	assert.Equal(t, []string{"u1:ns/claim-u1:gpu-0-mig-3g-40gb-4,"}, names(e.start().PreparedClaims()), "from the checkpoint at start")
}
