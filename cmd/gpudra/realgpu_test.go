package main

import (
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	resourceapi "k8s.io/api/resource/v1"
	"sigs.k8s.io/yaml"
)

// realGPUs pairs each simulated machine with the real GPU it models, as
// gpudra saw it: testdata/real-gpus/<capture> is a copy of
// ../shared/real-gpus/<capture> (README.md there). The real machines had one
// GPU in a VM, MIG mode off; the models are 8-GPU boards, so GPU 0 and the MIG
// profile table are compared.
var realGPUs = []struct {
	capture, machine string
	// mig is the model's MIG column; the real GPUs had MIG mode off.
	mig string
	// sameProfileOrder: the model lists the MIG profiles in the order the
	// real GPU does (NVML's enum order). The H100 model keeps the order of
	// ../shared/facts/h100.md, which is the one difference the H100 capture
	// showed; its rows are compared as a set.
	sameProfileOrder bool
}{
	{capture: "h200", machine: "hgx-h200-nomig", mig: "disabled", sameProfileOrder: true},
	{capture: "h200", machine: "hgx-h200", mig: "enabled", sameProfileOrder: true},
	{capture: "h100-80gb-hbm3", machine: "dgx-h100-nomig", mig: "disabled"},
}

// expectedToDiffer are the inventory table's columns that tell one GPU or
// one host from another: a model cannot have the real GPU's UUID, PCI bus
// or NUMA node, and the captures' VMs had no NVLink while the models are
// NVSwitch boards. (The first line, with the driver and CUDA versions and
// the GPU count, is only checked for its shape.)
var expectedToDiffer = []string{"UUID", "PCI BUS", "NUMA", "NVLINK", "DOMAIN"}

// expectedToDifferAttributes are the published attributes that differ for
// the same reasons, and the driver and CUDA versions the model is given
// (570.172.08 / 12.8; the captures ran 580.159.04 / 13.0).
var expectedToDifferAttributes = []resourceapi.QualifiedName{
	"uuid", "resource.kubernetes.io/pciBusID", "resource.kubernetes.io/numaNode", "nvlinkDomain",
	"driverVersion", "cudaDriverVersion",
}

// TestInventoryMatchesRealGPU: `gpudra inventory --backend sim` for each
// model prints GPU 0 and the MIG profile table as the real GPU's
// `gpudra inventory --backend nvml` did, but for what must differ.
func TestInventoryMatchesRealGPU(t *testing.T) {
	for _, tc := range realGPUs {
		t.Run(tc.machine, func(t *testing.T) {
			want := parseInventoryTable(t, readTestdata(t, tc.capture, "inventory.txt"))
			out, err := run(t, "inventory", "--backend", "sim", "--machine", tc.machine, "--node-name", "gpu-node")
			require.NoError(t, err)
			got := parseInventoryTable(t, out)

			summary := regexp.MustCompile(`^Driver \S+, CUDA \S+, \d+ GPU\(s\)$`)
			assert.Regexp(t, summary, want.summary)
			assert.Regexp(t, summary, got.summary)

			wantGPU, gotGPU := want.gpu0(t), got.gpu0(t)
			for _, col := range expectedToDiffer {
				delete(wantGPU, col)
				delete(gotGPU, col)
			}
			assert.Equal(t, "disabled", wantGPU["MIG"], "the captures had MIG mode off")
			wantGPU["MIG"] = tc.mig
			assert.Equal(t, wantGPU, gotGPU, "GPU 0")

			assert.Equal(t, want.profileTitle, got.profileTitle)
			assert.Equal(t, want.profileColumns, got.profileColumns)
			wantRows, gotRows := want.profiles, got.profiles
			if !tc.sameProfileOrder {
				wantRows, gotRows = sortedRows(wantRows), sortedRows(gotRows)
			}
			assert.Equal(t, wantRows, gotRows, "MIG profiles")
		})
	}
}

// TestSlicesMatchRealGPU: `gpudra slices --mig-devices all` for each model
// with MIG mode off publishes GPU 0, in a slice of the same name and pool,
// as the real GPU's `gpudra slices --backend nvml` did, but for what must
// differ. (A GPU in MIG mode publishes MIG placements, which the captures,
// MIG off, have nothing to compare with.)
func TestSlicesMatchRealGPU(t *testing.T) {
	for _, tc := range realGPUs {
		if tc.mig != "disabled" {
			continue
		}
		t.Run(tc.machine, func(t *testing.T) {
			want := parseSlices(t, readTestdata(t, tc.capture, "slices-mig-all.yaml"))
			require.Len(t, want, 1)
			require.Len(t, want[0].Spec.Devices, 1, "the capture is one GPU")
			out, err := run(t, "slices", "--backend", "sim", "--machine", tc.machine, "--node-name", "gpu-node", "--mig-devices", "all")
			require.NoError(t, err)
			got := parseSlices(t, out)

			wantSlice, wantDev := gpu0Slice(t, want)
			gotSlice, gotDev := gpu0Slice(t, got)
			assert.Equal(t, wantSlice, gotSlice, "the slice around GPU 0")
			for _, a := range expectedToDifferAttributes {
				delete(wantDev.Attributes, a)
				delete(gotDev.Attributes, a)
			}
			assert.Equal(t, wantDev, gotDev, "GPU 0's device")
		})
	}
}

func readTestdata(t *testing.T, capture, file string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "real-gpus", capture, file))
	require.NoError(t, err)
	return string(b)
}

// inventoryTable is `gpudra inventory`'s table, cell by cell.
type inventoryTable struct {
	summary        string
	gpuColumns     []string
	gpus           [][]string
	profileTitle   string
	profileColumns []string
	profiles       [][]string
}

// cells splits a tabwriter line: columns are two or more spaces apart, and
// no cell holds two spaces in a row.
var cellSep = regexp.MustCompile(`\s{2,}`)

func cells(line string) []string { return cellSep.Split(strings.TrimSpace(line), -1) }

func parseInventoryTable(t *testing.T, text string) inventoryTable {
	t.Helper()
	// Sections are separated by blank lines: summary, GPUs, MIG profiles
	// (and MIG devices, which neither side has here).
	sections := strings.Split(strings.TrimSpace(text), "\n\n")
	require.GreaterOrEqual(t, len(sections), 3, "summary, GPUs and MIG profiles in:\n%s", text)
	var tab inventoryTable
	tab.summary = strings.TrimSpace(sections[0])
	gpuLines := strings.Split(sections[1], "\n")
	tab.gpuColumns = cells(gpuLines[0])
	for _, l := range gpuLines[1:] {
		tab.gpus = append(tab.gpus, cells(l))
	}
	profLines := strings.Split(sections[2], "\n")
	require.GreaterOrEqual(t, len(profLines), 2)
	tab.profileTitle = profLines[0]
	tab.profileColumns = cells(profLines[1])
	for _, l := range profLines[2:] {
		row := cells(l)
		require.Len(t, row, len(tab.profileColumns), "profile row %q", l)
		tab.profiles = append(tab.profiles, row)
	}
	return tab
}

// gpu0 is the row of GPU index 0, by column name.
func (tab inventoryTable) gpu0(t *testing.T) map[string]string {
	t.Helper()
	for _, row := range tab.gpus {
		require.Len(t, row, len(tab.gpuColumns), "GPU row %q", row)
		if row[0] == "0" {
			out := map[string]string{}
			for i, c := range tab.gpuColumns {
				out[c] = row[i]
			}
			return out
		}
	}
	require.FailNow(t, "no GPU 0 in the table")
	return nil
}

func sortedRows(rows [][]string) [][]string {
	out := append([][]string(nil), rows...)
	sort.Slice(out, func(i, j int) bool { return out[i][0] < out[j][0] })
	return out
}

func parseSlices(t *testing.T, text string) []resourceapi.ResourceSlice {
	t.Helper()
	var out []resourceapi.ResourceSlice
	for _, doc := range strings.Split(text, "\n---\n") {
		var s resourceapi.ResourceSlice
		require.NoError(t, yaml.UnmarshalStrict([]byte(doc), &s))
		out = append(out, s)
	}
	return out
}

// gpu0Slice finds the slice that publishes gpu-0 and returns it without its
// devices, and the gpu-0 device.
func gpu0Slice(t *testing.T, slices []resourceapi.ResourceSlice) (resourceapi.ResourceSlice, resourceapi.Device) {
	t.Helper()
	for _, s := range slices {
		for _, d := range s.Spec.Devices {
			if d.Name == "gpu-0" {
				s = *s.DeepCopy()
				s.Spec.Devices = nil
				return s, *d.DeepCopy()
			}
		}
	}
	require.FailNow(t, "no slice publishes gpu-0")
	return resourceapi.ResourceSlice{}, resourceapi.Device{}
}
