package sim

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"
)

// formatUUID renders 16 bytes as 8-4-4-4-12 hex.
func formatUUID(b []byte) string {
	return fmt.Sprintf("%x-%x-%x-%x-%x", b[0:4], b[4:6], b[6:8], b[8:10], b[10:16])
}

// derivedUUID is a stable UUID from the given parts, so that a simulated node
// shows the same GPUs after every restart.
func derivedUUID(parts ...string) string {
	sum := sha256.Sum256([]byte("gpudra-sim/" + strings.Join(parts, "/")))
	return formatUUID(sum[:16])
}

func parseUUID(s string) ([16]byte, error) {
	var u [16]byte
	h := strings.ReplaceAll(s, "-", "")
	if len(h) != 32 || strings.Count(s, "-") != 4 {
		return u, fmt.Errorf("%q is not a UUID (8-4-4-4-12 hex digits)", s)
	}
	b, err := hex.DecodeString(h)
	if err != nil {
		return u, fmt.Errorf("%q is not a UUID: %w", s, err)
	}
	copy(u[:], b)
	return u, nil
}

// DGX H100 board layout: the GPUs' PCI buses as nvidia-smi shows them on a
// DGX H100, the first four on NUMA node 0, the rest on NUMA node 1.
var dgxH100Buses = []int{0x18, 0x2a, 0x3a, 0x5d, 0x9a, 0xab, 0xba, 0xdb}

// gpuBusID returns the PCI bus id of GPU index i: the DGX layout, repeated
// in further PCI domains for machines with more than eight GPUs.
func gpuBusID(i int) string {
	n := len(dgxH100Buses)
	return fmt.Sprintf("%04x:%02x:00.0", i/n, dgxH100Buses[i%n])
}

// nvswitchLinks is how a DGX H100 GPU's 18 NVLink links spread over its 4
// NVSwitch chips.
var nvswitchLinks = []int{5, 4, 4, 5}

// nvswitchBusID is the PCI bus id of NVSwitch s on the board.
func nvswitchBusID(s int) string { return fmt.Sprintf("0000:%02x:00.0", 0x05+s) }
