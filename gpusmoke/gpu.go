package gpusmoke

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/gpudra/gpudra/devcluster/nodeagent"
	"github.com/gpudra/gpudra/pkg/drivertools"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

// gpuUnderTest is what backs the GPU node: NVML on the real GPUs, or a
// simulated machine with stand-ins for the driver's nvidia-smi and
// libcuda.
type gpuUnderTest struct {
	// backend is NVML; nil for a simulated machine, which the node makes.
	backend    nvdevice.Interface
	driverRoot string
	simulated  string
	describe   string
	// mpsControl is what simulated nodes run as nvidia-cuda-mps-control.
	mpsControl string
	// standIns are the simulated machine's libcuda and nvidia-smi.
	standIns sim.DriverStandIns
	close    func()
}

// openGPU opens NVML and checks that nobody uses the GPUs, or prepares the
// simulated machine.
func openGPU(ctx context.Context, cfg Config) (*gpuUnderTest, error) {
	if cfg.Simulated != "" {
		return &gpuUnderTest{simulated: cfg.Simulated, describe: "simulated " + cfg.Simulated + " with stand-ins for nvidia-smi and libcuda",
			mpsControl: cfg.MPSControl, standIns: sim.DriverStandIns{LibCUDA: cfg.FakeLibCUDA, NvidiaSMI: true}, close: func() {}}, nil
	}
	if cfg.OpenNVML == nil {
		return nil, errors.New("this gpu-smoke was built without cgo, so without NVML: only --simulated runs (make gpu-smoke builds it with cgo)")
	}
	backend, closeNVML, err := cfg.OpenNVML(ctx, cfg.DriverRoot)
	if err != nil {
		return nil, fmt.Errorf("no NVIDIA GPU to test here: %w", err)
	}
	if err := checkIdle(ctx, cfg.DriverRoot); err != nil {
		closeNVML()
		return nil, err
	}
	return &gpuUnderTest{backend: backend, driverRoot: cfg.DriverRoot, describe: "NVML", close: closeNVML}, nil
}

// nodeOptions are the GPU node's: MIG policy existing, so that nothing
// creates or destroys a MIG device on a real GPU.
func (g *gpuUnderTest) nodeOptions(mig *slicebuilder.MigPolicy) nodeagent.NodeOptions {
	if g.backend != nil {
		return nodeagent.NodeOptions{Name: GPUNode, Backend: g.backend, DriverRoot: g.driverRoot, MigDevices: mig}
	}
	return nodeagent.NodeOptions{Name: GPUNode, Machine: g.simulated, MigDevices: mig, DriverStandIns: g.standIns}
}

// checkIdle refuses GPUs that other processes use: the smoke test must
// disturb nothing.
func checkIdle(ctx context.Context, driverRoot string) error {
	cmd, err := drivertools.Runner{Root: driverRoot}.Command(ctx, "nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader")
	if err != nil {
		return fmt.Errorf("nvidia-smi: %w", err)
	}
	out, err := cmd.Output()
	if err != nil {
		return fmt.Errorf("nvidia-smi --query-compute-apps: %w", err)
	}
	if s := strings.TrimSpace(string(out)); s != "" {
		return fmt.Errorf("the GPUs are in use (pid, GPU: %s): gpu-smoke runs only where no other process uses them", strings.ReplaceAll(s, "\n", "; "))
	}
	return nil
}
