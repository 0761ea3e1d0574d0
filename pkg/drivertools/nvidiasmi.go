package drivertools

import (
	"context"
	"fmt"
	"strconv"
	"strings"
)

// NvidiaSMI sets time slices with nvidia-smi: NVML has no call for it. It
// is the NVML backend's nvdevice.ComputePolicy.
type NvidiaSMI struct {
	// Runner runs it from the driver root, through the root's own loader.
	Runner Runner
	// Path is nvidia-smi as Runner.Path takes it; empty: "nvidia-smi",
	// looked for in ToolDirs under the driver root.
	Path string
}

// SetTimeSlice runs `nvidia-smi compute-policy -i <uuid> --set-timeslice <level>`.
func (n NvidiaSMI) SetTimeSlice(ctx context.Context, gpuUUID string, level int) error {
	tool := n.Path
	if tool == "" {
		tool = "nvidia-smi"
	}
	cmd, err := n.Runner.Command(ctx, tool, "compute-policy", "-i", gpuUUID, "--set-timeslice", strconv.Itoa(level))
	if err != nil {
		return fmt.Errorf("setting the time slice of %s: %w", gpuUUID, err)
	}
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s compute-policy -i %s --set-timeslice %d: %w: %s", tool, gpuUUID, level, err, strings.TrimSpace(string(out)))
	}
	return nil
}
