package sharing

import (
	"context"
	"fmt"
	"os/exec"
	"strconv"
	"strings"
)

// NvidiaSMI sets time slices with nvidia-smi: NVML has no call for it.
type NvidiaSMI struct {
	// Path is the nvidia-smi binary (under the driver root).
	Path string
}

// SetTimeSlice runs `nvidia-smi compute-policy -i <uuid> --set-timeslice <level>`.
func (n NvidiaSMI) SetTimeSlice(ctx context.Context, gpuUUID string, level int) error {
	out, err := exec.CommandContext(ctx, n.Path, "compute-policy", "-i", gpuUUID, "--set-timeslice", strconv.Itoa(level)).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s compute-policy -i %s --set-timeslice %d: %w: %s", n.Path, gpuUUID, level, err, strings.TrimSpace(string(out)))
	}
	return nil
}
