package nvdevice

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestParseMajors(t *testing.T) {
	for _, tc := range []struct {
		name, in string
		want     DeviceMajors
		err      string
	}{
		{name: "frontend, caps and uvm",
			in:   "Character devices:\n  1 mem\n195 nvidia-frontend\n234 nvidia-caps\n508 nvidia-uvm\n\nBlock devices:\n  8 sd\n",
			want: DeviceMajors{NVIDIA: 195, UVM: 508, Caps: 234}},
		{name: "plain nvidia module, no caps (MIG capabilities not loaded)",
			in:   "Character devices:\n195 nvidia\n511 nvidia-uvm\n",
			want: DeviceMajors{NVIDIA: 195, UVM: 511}},
		{name: "nvidia defaults to 195",
			in:   "Character devices:\n510 nvidia-uvm\n509 nvidia-caps\n",
			want: DeviceMajors{NVIDIA: 195, UVM: 510, Caps: 509}},
		{name: "no nvidia-uvm", in: "Character devices:\n195 nvidia-frontend\n",
			err: "no nvidia-uvm entry: is the nvidia-uvm module loaded?"},
		{name: "a line without a major is skipped", in: "Character devices:\nuvm nvidia-uvm\n",
			err: "no nvidia-uvm entry: is the nvidia-uvm module loaded?"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, err := ParseMajors(strings.NewReader(tc.in))
			if tc.err != "" {
				require.EqualError(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want, m)
		})
	}
}

func TestMajorsFromProc(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "devices")
	require.NoError(t, os.WriteFile(good, []byte("Character devices:\n195 nvidia-frontend\n508 nvidia-uvm\n511 nvidia-caps\n"), 0o600))
	noUVM := filepath.Join(dir, "devices-no-uvm")
	require.NoError(t, os.WriteFile(noUVM, []byte("Character devices:\n195 nvidia-frontend\n"), 0o600))

	m, err := MajorsFromProc(good)
	require.NoError(t, err)
	assert.Equal(t, DeviceMajors{NVIDIA: 195, UVM: 508, Caps: 511}, m)

	_, err = MajorsFromProc(noUVM)
	require.EqualError(t, err, "device majors from "+noUVM+": no nvidia-uvm entry: is the nvidia-uvm module loaded?",
		"the error names the file")

	_, err = MajorsFromProc(filepath.Join(dir, "missing"))
	require.ErrorIs(t, err, os.ErrNotExist)
}

func TestParseMigMinors(t *testing.T) {
	for _, tc := range []struct {
		name, in string
		want     map[string]int
		err      string
	}{
		{name: "driver layout",
			in:   "config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\n",
			want: map[string]int{"config": 1, "monitor": 2, "gpu0/gi1/access": 12, "gpu0/gi1/ci0/access": 13}},
		{name: "blank lines skipped", in: "\ngpu1/gi0/access 138\n\n", want: map[string]int{"gpu1/gi0/access": 138}},
		{name: "empty", in: "", want: map[string]int{}},
		{name: "minor not a number", in: "gpu0/gi1/access twelve\n", err: `line 1: minor "twelve"`},
		{name: "three fields", in: "config 1\ngpu0/gi1/access 12 13\n", err: `line 2: want "<path> <minor>"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			m, err := ParseMigMinors(strings.NewReader(tc.in))
			if tc.err != "" {
				require.ErrorContains(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want, m)
		})
	}
}

func TestMigMinorsFromFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "mig-minors")
	minors := MigMinorsFromFile(path)

	_, _, err := minors(0, 1, 0)
	require.ErrorIs(t, err, os.ErrNotExist, "no file yet: an error at the call, not at construction")

	// Written after the resolver was made, as when the MIG capability
	// module loads after the plugin started: the file is read at every call.
	require.NoError(t, os.WriteFile(path, []byte("config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\ngpu0/gi1/ci1/access 14\n"), 0o600))
	for _, tc := range []struct {
		name           string
		gpu, gi, ci    int
		wantGI, wantCI int
		err            string
	}{
		{name: "first compute instance", gpu: 0, gi: 1, ci: 0, wantGI: 12, wantCI: 13},
		{name: "second compute instance", gpu: 0, gi: 1, ci: 1, wantGI: 12, wantCI: 14},
		{name: "unknown compute instance", gpu: 0, gi: 1, ci: 2, err: "no entry for gpu0/gi1/access or gpu0/gi1/ci2/access"},
		{name: "unknown GPU", gpu: 1, gi: 1, ci: 0, err: "no entry for gpu1/gi1/access or gpu1/gi1/ci0/access"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			gi, ci, err := minors(tc.gpu, tc.gi, tc.ci)
			if tc.err != "" {
				require.ErrorContains(t, err, tc.err)
				require.ErrorContains(t, err, path, "the error names the file")
				return
			}
			require.NoError(t, err)
			assert.Equal(t, [2]int{tc.wantGI, tc.wantCI}, [2]int{gi, ci})
		})
	}

	require.NoError(t, os.WriteFile(path, []byte("gpu0/gi1/access x\n"), 0o600))
	_, _, err = minors(0, 1, 0)
	require.ErrorContains(t, err, "MIG capability minors in "+path+`: line 1: minor "x"`)
}
