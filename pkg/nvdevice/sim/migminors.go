package sim

import (
	"fmt"
	"io"
)

// The driver's layout of the MIG capability minors: "config" is 1 and
// "monitor" 2, then per GPU migGIs GPU instances, each one access node
// followed by migCIs compute instances.
const (
	migGIs        = 15
	migCIs        = 8
	firstMigMinor = 3
	// minorsPerGPU: one access node per GPU instance and one per compute
	// instance.
	minorsPerGPU = migGIs * (1 + migCIs)
)

// migCapMinors are the minors of the access nodes of GPU instance gi and of
// its compute instance ci on GPU gpu, numbered as the driver does.
func migCapMinors(gpu, gi, ci int) (giMinor, ciMinor int) {
	giMinor = firstMigMinor + gpu*minorsPerGPU + gi*(1+migCIs)
	return giMinor, giMinor + 1 + ci
}

// WriteMigMinors writes a /proc/driver/nvidia-caps/mig-minors file for a
// machine with gpus GPUs, in the driver's layout: "config" and "monitor",
// then per GPU 15 GPU instances of one access node and 8 compute instances
// each. Host's CapMinors gives the same numbers without the file.
func WriteMigMinors(w io.Writer, gpus int) error {
	if _, err := fmt.Fprintf(w, "config 1\nmonitor 2\n"); err != nil {
		return err
	}
	for g := 0; g < gpus; g++ {
		for gi := 0; gi < migGIs; gi++ {
			giMinor, _ := migCapMinors(g, gi, 0)
			if _, err := fmt.Fprintf(w, "gpu%d/gi%d/access %d\n", g, gi, giMinor); err != nil {
				return err
			}
			for ci := 0; ci < migCIs; ci++ {
				_, ciMinor := migCapMinors(g, gi, ci)
				if _, err := fmt.Fprintf(w, "gpu%d/gi%d/ci%d/access %d\n", g, gi, ci, ciMinor); err != nil {
					return err
				}
			}
		}
	}
	return nil
}
