package sharing

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
)

// NvidiaSMI sets time slices with nvidia-smi: NVML has no call for it.
type NvidiaSMI struct {
	// Path is the nvidia-smi binary (under the driver root).
	Path string
	// Env is added to its environment (LD_LIBRARY_PATH for a driver root
	// other than /).
	Env []string
}

// SetTimeSlice runs `nvidia-smi compute-policy -i <uuid> --set-timeslice <level>`.
func (n NvidiaSMI) SetTimeSlice(ctx context.Context, gpuUUID string, level int) error {
	cmd := exec.CommandContext(ctx, n.Path, "compute-policy", "-i", gpuUUID, "--set-timeslice", strconv.Itoa(level))
	cmd.Env = append(os.Environ(), n.Env...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s compute-policy -i %s --set-timeslice %d: %w: %s", n.Path, gpuUUID, level, err, strings.TrimSpace(string(out)))
	}
	return nil
}
