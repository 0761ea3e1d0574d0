package plugin

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"

	"github.com/gpudra/gpudra/pkg/cdi"
)

// SimulatedMajors are the majors used with the simulated backend: 195 as
// the driver fixes it, and typical values for the dynamic ones.
var SimulatedMajors = cdi.Majors{NVIDIA: 195, UVM: 508, Caps: 511}

// ParseMajors reads the character device majors of the NVIDIA modules from
// /proc/devices.
func ParseMajors(r io.Reader) (cdi.Majors, error) {
	m := cdi.Majors{NVIDIA: 195}
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) != 2 {
			continue
		}
		n, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			continue
		}
		switch f[1] {
		case "nvidia-frontend", "nvidia":
			m.NVIDIA = n
		case "nvidia-uvm":
			m.UVM = n
		case "nvidia-caps":
			m.Caps = n
		}
	}
	if err := sc.Err(); err != nil {
		return m, err
	}
	if m.UVM == 0 {
		return m, fmt.Errorf("no nvidia-uvm entry: is the nvidia-uvm module loaded?")
	}
	return m, nil
}

// MajorsFromProc reads /proc/devices.
func MajorsFromProc(path string) (cdi.Majors, error) {
	f, err := os.Open(path)
	if err != nil {
		return cdi.Majors{}, fmt.Errorf("device majors: %w", err)
	}
	defer f.Close()
	m, err := ParseMajors(f)
	if err != nil {
		return m, fmt.Errorf("device majors from %s: %w", path, err)
	}
	return m, nil
}
