package nvdevice

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
)

// The driver's files under /proc that a real backend reads its Host from,
// relative to the proc root.
const (
	// ProcDevices lists the character device majors.
	ProcDevices = "devices"
	// ProcMigMinors lists the minors of the /dev/nvidia-caps nodes of every
	// possible GPU and compute instance.
	ProcMigMinors = "driver/nvidia-caps/mig-minors"
)

// ParseMajors reads the character device majors of the NVIDIA modules from
// /proc/devices. A missing nvidia-uvm is an error: without it no CUDA
// container works, and a spec with major 0 would fail late and obscurely.
func ParseMajors(r io.Reader) (DeviceMajors, error) {
	m := DeviceMajors{NVIDIA: 195}
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

// MajorsFromProc reads the majors from path, a /proc/devices file.
func MajorsFromProc(path string) (DeviceMajors, error) {
	f, err := os.Open(path)
	if err != nil {
		return DeviceMajors{}, fmt.Errorf("device majors: %w", err)
	}
	defer f.Close()
	m, err := ParseMajors(f)
	if err != nil {
		return m, fmt.Errorf("device majors from %s: %w", path, err)
	}
	return m, nil
}

// ParseMigMinors reads lines like "gpu0/gi1/access 12" and
// "gpu0/gi1/ci0/access 13" into a map from the path to the minor.
func ParseMigMinors(r io.Reader) (map[string]int, error) {
	out := map[string]int{}
	sc := bufio.NewScanner(r)
	for line := 1; sc.Scan(); line++ {
		fields := strings.Fields(sc.Text())
		if len(fields) == 0 {
			continue
		}
		if len(fields) != 2 {
			return nil, fmt.Errorf("line %d: want \"<path> <minor>\", got %q", line, sc.Text())
		}
		minor, err := strconv.Atoi(fields[1])
		if err != nil {
			return nil, fmt.Errorf("line %d: minor %q: %w", line, fields[1], err)
		}
		out[fields[0]] = minor
	}
	return out, sc.Err()
}

// MigMinorsFromFile resolves capability minors from the driver's file,
// read at every call: it is small, and reading it late keeps the plugin
// starting on nodes where the MIG capability module loads after it.
func MigMinorsFromFile(path string) func(gpuMinor, gi, ci int) (int, int, error) {
	return func(gpuMinor, gi, ci int) (int, int, error) {
		f, err := os.Open(path)
		if err != nil {
			return 0, 0, fmt.Errorf("MIG capability minors: %w", err)
		}
		defer f.Close()
		minors, err := ParseMigMinors(f)
		if err != nil {
			return 0, 0, fmt.Errorf("MIG capability minors in %s: %w", path, err)
		}
		giKey := fmt.Sprintf("gpu%d/gi%d/access", gpuMinor, gi)
		ciKey := fmt.Sprintf("gpu%d/gi%d/ci%d/access", gpuMinor, gi, ci)
		giMinor, ok1 := minors[giKey]
		ciMinor, ok2 := minors[ciKey]
		if !ok1 || !ok2 {
			return 0, 0, fmt.Errorf("MIG capability minors in %s: no entry for %s or %s", path, giKey, ciKey)
		}
		return giMinor, ciMinor, nil
	}
}
