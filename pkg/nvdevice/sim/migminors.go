package sim

import (
	"fmt"
	"io"
)

// WriteMigMinors writes a /proc/driver/nvidia-caps/mig-minors file for a
// machine with gpus GPUs, in the driver's layout: "config" and "monitor",
// then per GPU 15 GPU instances of one access node and 8 compute instances
// each.
func WriteMigMinors(w io.Writer, gpus int) error {
	if _, err := fmt.Fprintf(w, "config 1\nmonitor 2\n"); err != nil {
		return err
	}
	minor := 3
	for g := 0; g < gpus; g++ {
		for gi := 0; gi < 15; gi++ {
			if _, err := fmt.Fprintf(w, "gpu%d/gi%d/access %d\n", g, gi, minor); err != nil {
				return err
			}
			minor++
			for ci := 0; ci < 8; ci++ {
				if _, err := fmt.Fprintf(w, "gpu%d/gi%d/ci%d/access %d\n", g, gi, ci, minor); err != nil {
					return err
				}
				minor++
			}
		}
	}
	return nil
}
