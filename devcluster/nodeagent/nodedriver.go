package nodeagent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/devcluster/noderuntime"
	"github.com/gpudra/gpudra/pkg/drivertools"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
)

// nodeDriver is what a node's driver gives its plugin and kubelet.
type nodeDriver struct {
	// mpsControl is the plugin's nvidia-cuda-mps-control ("": no MPS).
	mpsControl string
	// hostDriverRoot is the driver root MPS server pods mount.
	hostDriverRoot string
	// devices name the GPUs a container's device nodes give it,
	// hostDevices stat the node's device nodes, under devRoot's dev/.
	devices     noderuntime.DeviceIdentifier
	hostDevices noderuntime.HostDevice
	devRoot     string
}

// setUpDriver lays out the node's driver. A simulated machine gets a fake
// driver root with the real layout (so the plugin's common CDI spec mounts
// real paths), devcluster's MPS control stand-in and real device nodes. A
// real backend keeps its own driver root and the host's /dev.
func setUpDriver(ctx context.Context, n *Node, machine *sim.Machine, opts NodeOptions, mpsControlBinary string) (nodeDriver, error) {
	if machine == nil {
		return realDriver(n)
	}
	d := nodeDriver{hostDriverRoot: n.driverRoot}
	if err := machine.WriteDriverRoot(n.DriverRoot(), opts.DriverStandIns); err != nil {
		return d, err
	}
	machine.SetDriverRoot(n.DriverRoot())
	var err error
	if d.mpsControl, err = installMPSControl(mpsControlBinary, n.DriverRoot()); err != nil {
		return d, err
	}
	// The machine's /dev: real character devices under the node's
	// directory, which the runtime stats; the model where mknod is
	// refused.
	d.devices, d.hostDevices, d.devRoot = noderuntime.MachineDevices(machine), noderuntime.HostDevicesUnder(n.Dir), n.Dir
	if err := machine.WriteDevNodes(n.Dir); err != nil {
		klog.FromContext(ctx).Info("The simulated /dev holds no device nodes; the runtime reads the machine's model instead", "node", opts.Name, "reason", err.Error())
		d.hostDevices = noderuntime.MachineHostDevices(machine)
	}
	return d, nil
}

// realDriver is a real backend's driver: its own nvidia-cuda-mps-control,
// found as the plugin's --mps-control-binary default finds it, and its
// root linked at <node>/driver: the chart is rendered with every node's
// driver root there, and its admission policy holds MPS server pods to
// that hostPath (a hostPath that is a link mounts what it names).
func realDriver(n *Node) (nodeDriver, error) {
	d := nodeDriver{devices: noderuntime.BackendDevices(n.backend), hostDevices: noderuntime.HostDevicesUnder("/"), devRoot: "/", hostDriverRoot: n.DriverRoot()}
	if p, ok := (drivertools.Runner{Root: n.driverRoot}).Path("nvidia-cuda-mps-control"); ok {
		d.mpsControl = p
	}
	if err := os.Symlink(n.driverRoot, n.DriverRoot()); err != nil && !errors.Is(err, os.ErrExist) {
		return d, fmt.Errorf("link the driver root: %w", err)
	}
	return d, nil
}

// installMPSControl puts the stand-in nvidia-cuda-mps-control
// (binary, devcluster.Options.MPSControlBinary) where a driver install has it, under the
// node's driver root: MPS server pods run the driver root's own, as the
// chart's admission policy allows no other. Empty: no MPS.
func installMPSControl(binary, driverRoot string) (string, error) {
	if binary == "" {
		return "", nil
	}
	b, err := os.ReadFile(binary)
	if err != nil {
		return "", fmt.Errorf("the MPS control stand-in: %w", err)
	}
	dst := filepath.Join(driverRoot, sim.BinDir, "nvidia-cuda-mps-control")
	if err := os.Remove(dst); err != nil && !errors.Is(err, os.ErrNotExist) {
		return "", err
	}
	if err := os.WriteFile(dst, b, 0o755); err != nil { //nolint:gosec // an executable
		return "", fmt.Errorf("install the MPS control stand-in: %w", err)
	}
	return dst, nil
}
