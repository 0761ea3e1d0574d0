package nvml

import (
	"path/filepath"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

// DefaultProcRoot is the host's /proc when Options.ProcRoot is empty.
const DefaultProcRoot = "/proc"

// hostOf is the Host of a real node: the majors from /proc/devices, read
// now (a node without nvidia-uvm cannot run CUDA containers, and says so at
// start), and the capability minors from the driver's mig-minors file, read
// at each call. Outside the cgo files so that it is tested without cgo.
func hostOf(opts Options) (nvdevice.Host, error) {
	proc := opts.ProcRoot
	if proc == "" {
		proc = DefaultProcRoot
	}
	majors, err := nvdevice.MajorsFromProc(filepath.Join(proc, nvdevice.ProcDevices))
	if err != nil {
		return nvdevice.Host{}, err
	}
	return nvdevice.Host{
		Majors:        majors,
		CapMinors:     nvdevice.MigMinorsFromFile(filepath.Join(proc, nvdevice.ProcMigMinors)),
		ComputePolicy: opts.ComputePolicy,
	}, nil
}
