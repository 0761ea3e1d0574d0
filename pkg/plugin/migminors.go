package plugin

import (
	"bufio"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
)

// DefaultMigMinorsPath is where the driver lists the minors of the
// /dev/nvidia-caps nodes of every possible GPU and compute instance.
const DefaultMigMinorsPath = "/proc/driver/nvidia-caps/mig-minors"

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
func MigMinorsFromFile(path string) CapMinors {
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
