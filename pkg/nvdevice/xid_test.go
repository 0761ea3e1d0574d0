package nvdevice

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

func TestXIDRecovery(t *testing.T) {
	for _, tc := range []struct {
		xid  uint64
		want Recovery
	}{
		{8, RecoverWhenAnswering},  // GPU stopped processing: RESTART_APP
		{31, RecoverWhenAnswering}, // MMU fault: an application's
		{46, RecoverGPUReset},      // GPU timeout
		{48, RecoverGPUReset},      // double-bit ECC error: row remapping at the next reset
		{62, RecoverGPUReset},      // PMU halt
		{63, RecoverWhenAnswering}, // row remapping recorded: IGNORE
		{64, RecoverGPUReset},      // row remapping failure
		{74, RecoverGPUReset},      // NVLink error
		{79, RecoverNodeReboot},    // fallen off the bus: RESTART_BM
		{92, RecoverWhenAnswering}, // high single-bit ECC rate: IGNORE
		{94, RecoverWhenAnswering}, // contained ECC error: RESTART_APP
		{95, RecoverGPUReset},      // uncontained ECC error
		{119, RecoverGPUReset},     // GSP RPC timeout
		{120, RecoverGPUReset},     // GSP error
		{140, RecoverGPUReset},     // unrecoverable ECC error escape
		{151, RecoverNodeReboot},   // key rotation: RESTART_VM
		{154, RecoverGPUReset},     // recovery action changed
		{160, RecoverNodeReboot},   // channel retirement: RESTART_BM
		{100000, RecoverWhenAnswering},
	} {
		assert.Equal(t, tc.want, XIDRecovery(tc.xid), "XID %d", tc.xid)
		ev := HealthEvent{Kind: HealthXID, XID: tc.xid}
		assert.Equal(t, tc.want, ev.Recovery(), "XID %d event", tc.xid)
		assert.Equal(t, tc.want != RecoverWhenAnswering, ev.Recovery().NeedsReset(), "XID %d", tc.xid)
	}
}

func TestXIDTablesAreConsistent(t *testing.T) {
	for xid := range gpuResetXIDs {
		assert.False(t, nodeRebootXIDs[xid], "XID %d is in both tables", xid)
		assert.False(t, ApplicationXIDs[xid], "XID %d needs a reset but is never critical", xid)
	}
	for xid := range nodeRebootXIDs {
		assert.False(t, ApplicationXIDs[xid], "XID %d needs a reboot but is never critical", xid)
	}
}

func TestEventRecovery(t *testing.T) {
	assert.Equal(t, RecoverWhenAnswering, HealthEvent{Kind: HealthGPULost}.Recovery(), "a lost GPU that answers again was reinitialised")
	assert.Equal(t, RecoverWhenAnswering, HealthEvent{Kind: HealthRecovered}.Recovery())
	assert.Equal(t, RecoverNodeReboot, HealthEvent{Kind: HealthXID, XID: 79}.Recovery())
	assert.True(t, RecoverNodeReboot > RecoverGPUReset && RecoverGPUReset > RecoverWhenAnswering, "ordered by what they need")
	assert.Equal(t, "gpu-reset", RecoverGPUReset.String())
}
