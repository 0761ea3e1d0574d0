package sim

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// ErrDevNodesRefused: the host does not let this process create device
// nodes (not root, a user namespace); the machine's /dev then exists only
// in its model.
var ErrDevNodesRefused = errors.New("mknod refused")

// DevNode is one character device of the machine's /dev.
type DevNode struct {
	// Path is the node's path on the machine ("/dev/nvidia0").
	Path         string
	Major, Minor uint32
}

// DevNodes are the character devices a node with the NVIDIA driver has:
// /dev/nvidiactl, /dev/nvidia-uvm, /dev/nvidia-uvm-tools, /dev/nvidia<minor>
// of each GPU, and /dev/nvidia-caps/nvidia-cap<N> for the MIG "config" and
// "monitor" capabilities and every GPU and compute instance the driver
// numbers (mig-minors), whether or not it exists: as nvidia-modprobe
// leaves them, so that a MIG device created later has its nodes already.
func (m *Machine) DevNodes() []DevNode {
	nodes := []DevNode{
		{Path: "/dev/nvidiactl", Major: uint32(Majors.NVIDIA), Minor: 255},
		{Path: "/dev/nvidia-uvm", Major: uint32(Majors.UVM), Minor: 0},
		{Path: "/dev/nvidia-uvm-tools", Major: uint32(Majors.UVM), Minor: 1},
	}
	capNode := func(minor int) DevNode {
		return DevNode{Path: fmt.Sprintf("/dev/nvidia-caps/nvidia-cap%d", minor), Major: uint32(Majors.Caps), Minor: uint32(minor)}
	}
	nodes = append(nodes, capNode(1), capNode(2))
	for _, g := range m.Devices() {
		nodes = append(nodes, DevNode{Path: fmt.Sprintf("/dev/nvidia%d", g.Minor), Major: uint32(Majors.NVIDIA), Minor: uint32(g.Minor)})
		for gi := 0; gi < migGIs; gi++ {
			giMinor, _ := migCapMinors(g.Minor, gi, 0)
			nodes = append(nodes, capNode(giMinor))
			for ci := 0; ci < migCIs; ci++ {
				_, ciMinor := migCapMinors(g.Minor, gi, ci)
				nodes = append(nodes, capNode(ciMinor))
			}
		}
	}
	return nodes
}

// WriteDevNodes creates the machine's device nodes (DevNodes) under root,
// root/dev/nvidia0 and so on, as real character devices with the
// machine's majors and minors: what a runtime stats for a device plugin's
// DeviceSpec, and what the CDI specs' numbers must match. Nodes already
// there are replaced. Where mknod is refused it returns an error wrapping
// ErrDevNodesRefused and leaves nothing half made.
func (m *Machine) WriteDevNodes(root string) error {
	nodes := m.DevNodes()
	for _, n := range nodes {
		p := filepath.Join(root, n.Path)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			return fmt.Errorf("simulated /dev: %w", err)
		}
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("simulated /dev: %w", err)
		}
		if err := unix.Mknod(p, unix.S_IFCHR|0o666, int(unix.Mkdev(n.Major, n.Minor))); err != nil {
			_ = os.RemoveAll(filepath.Join(root, "dev"))
			if errors.Is(err, unix.EPERM) || errors.Is(err, unix.EACCES) {
				return fmt.Errorf("simulated /dev: mknod %s: %w: %w", p, ErrDevNodesRefused, err)
			}
			return fmt.Errorf("simulated /dev: mknod %s: %w", p, err)
		}
	}
	return nil
}
