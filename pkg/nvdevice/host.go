package nvdevice

import "context"

// Host is what the kubelet plugin needs to know about its node beyond the
// GPUs themselves: how to name the device nodes a container gets, and how
// to change the GPUs' compute policy. A backend hands it over in one value
// (Interface.Host), so that the plugin never reads the host on its own and
// the simulator can stand in for all of it.
type Host struct {
	// Majors are the character device majors of the NVIDIA modules.
	Majors DeviceMajors
	// CapMinors resolves the /dev/nvidia-caps minors of a MIG device's GPU
	// instance gi and compute instance ci on the GPU of minor gpuMinor.
	// Never nil.
	CapMinors func(gpuMinor, gi, ci int) (giMinor, ciMinor int, err error)
	// ComputePolicy sets time slices; nil: this node cannot, and
	// time-sliced claims are refused.
	ComputePolicy ComputePolicy
}

// DeviceMajors are the major numbers of the NVIDIA character devices.
// nvidiactl and the GPUs use 195; nvidia-uvm and nvidia-caps are allocated
// at module load, so a real node reads them from /proc/devices.
type DeviceMajors struct {
	NVIDIA int64
	UVM    int64
	Caps   int64
}

// ComputePolicy changes how a GPU schedules the processes that share it.
// NVML has no call for the time slice, so the real implementation runs
// nvidia-smi (drivertools.NvidiaSMI); the simulator records what was set.
type ComputePolicy interface {
	// SetTimeSlice sets the GPU's time slice: 0 (default) to 3 (long), the
	// values of `nvidia-smi compute-policy --set-timeslice`.
	SetTimeSlice(ctx context.Context, gpuUUID string, level int) error
}
