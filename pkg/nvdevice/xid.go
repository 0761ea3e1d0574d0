package nvdevice

import (
	"fmt"
	"time"
)

// Recovery is what has to happen before a GPU that reported a fault can be
// trusted again. The values are ordered: a larger one needs more.
type Recovery int

const (
	// RecoverWhenAnswering: the fault ends with the processes it hit. The
	// GPU is trusted again once it answers and has stayed quiet (no further
	// critical event) for a while.
	RecoverWhenAnswering Recovery = iota
	// RecoverGPUReset: the GPU must be reset (`nvidia-smi -r`) first.
	RecoverGPUReset
	// RecoverNodeReboot: only a reboot of the node clears the fault.
	RecoverNodeReboot
)

func (r Recovery) String() string {
	switch r {
	case RecoverWhenAnswering:
		return "none"
	case RecoverGPUReset:
		return "gpu-reset"
	case RecoverNodeReboot:
		return "node-reboot"
	}
	return fmt.Sprintf("Recovery(%d)", int(r))
}

// NeedsReset reports whether the GPU has to be reset (or the node rebooted)
// before it can be trusted again.
func (r Recovery) NeedsReset() bool { return r >= RecoverGPUReset }

// Defaults both backends use for the recovery of an unhealthy GPU.
const (
	// DefaultRecoveryCheckInterval is how often an unhealthy GPU is checked.
	DefaultRecoveryCheckInterval = 30 * time.Second
	// DefaultRecoveryQuietPeriod is how long after its last critical event
	// a GPU must stay quiet before it is healthy again. It also covers the
	// driver setting the GPU's recovery action a moment after the XID (XID
	// 154 follows the XID that caused it).
	DefaultRecoveryQuietPeriod = 5 * time.Minute
)

// XIDs by what it takes to recover from them, from the "Resolution Bucket
// (Immediate Action)" column of NVIDIA's XID catalog for Ampere and newer
// GPUs, https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html
// (NVIDIA's NVSentinel ships the same column as
// distros/kubernetes/nvsentinel/charts/gpu-health-monitor/xiderrorsmapping.csv).
// RESET_GPU needs a GPU reset; RESTART_BM and RESTART_VM a reboot. Where the
// catalog names a workflow instead of an action, the XID is put here when
// the workflow can end in a reset, since when unsure a GPU stays tainted:
//   - 48 (DBE, WORKFLOW_XID_48): the double-bit error is followed by a
//     contained (94) or uncontained (95) error and a row remapping that
//     takes effect at the next reset;
//   - 74 (NVLink, WORKFLOW_NVLINK_ERR) and 144-150 (NVLink5 workflows): the
//     link comes back with a GPU reset;
//   - 154 (GPU recovery action changed): the driver's own statement that the
//     GPU needs something; the recovery action says what.
//
// Every other XID (RESTART_APP, IGNORE, CHECK_*, UNEXPECTED_ERR_REPORT_ISSUE,
// among them 63 row-remapping recorded, 92 high single-bit ECC rate and 94
// contained ECC error) ends with the processes it hit: the GPU is usable
// again by new processes. Where the driver reports the GPU's recovery
// action (NVML field FI_DEV_GET_GPU_RECOVERY_ACTION), the NVML backend
// trusts it over this table.
var (
	gpuResetXIDs = map[uint64]bool{
		46: true, 48: true, 62: true, 64: true, 74: true, 95: true, 110: true,
		119: true, 120: true, 136: true, 140: true, 143: true,
		144: true, 145: true, 146: true, 147: true, 148: true, 149: true, 150: true,
		154: true, 155: true, 156: true, 158: true, 162: true,
	}
	nodeRebootXIDs = map[uint64]bool{79: true, 151: true, 160: true}
)

// XIDRecovery says what it takes to recover from a critical XID. 109 (a
// context-switch timeout) is RESET_GPU in the catalog but one of the
// ApplicationXIDs, which never make a device unhealthy, so it is not listed.
func XIDRecovery(xid uint64) Recovery {
	switch {
	case nodeRebootXIDs[xid]:
		return RecoverNodeReboot
	case gpuResetXIDs[xid]:
		return RecoverGPUReset
	}
	return RecoverWhenAnswering
}

// Recovery says what it takes to recover from the event: for an XID what
// XIDRecovery says, for a lost GPU that it answers again (a GPU that comes
// back on the bus has been reinitialised).
func (e HealthEvent) Recovery() Recovery {
	if e.Kind == HealthXID {
		return XIDRecovery(e.XID)
	}
	return RecoverWhenAnswering
}

// UnhealthyTracker is implemented by backends that check unhealthy GPUs and
// publish HealthRecovered when one can be trusted again. A backend only
// knows the faults it saw itself: a plugin that restarts hands it those it
// remembers, so that they can recover too.
type UnhealthyTracker interface {
	// TrackUnhealthy has the backend treat the GPU as unhealthy because of
	// ev (a critical event seen before), as if it had seen ev itself. It
	// is called after WatchHealth; non-critical events are ignored.
	TrackUnhealthy(ev HealthEvent) error
}
