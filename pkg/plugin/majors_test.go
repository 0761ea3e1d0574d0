package plugin

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/cdi"
)

func TestParseMajors(t *testing.T) {
	m, err := ParseMajors(strings.NewReader("Character devices:\n  1 mem\n195 nvidia-frontend\n234 nvidia-caps\n508 nvidia-uvm\n\nBlock devices:\n  8 sd\n"))
	require.NoError(t, err)
	assert.Equal(t, cdi.Majors{NVIDIA: 195, UVM: 508, Caps: 234}, m)
	_, err = ParseMajors(strings.NewReader("Character devices:\n195 nvidia-frontend\n"))
	require.EqualError(t, err, "no nvidia-uvm entry: is the nvidia-uvm module loaded?")
}

func TestParseMigMinors(t *testing.T) {
	m, err := ParseMigMinors(strings.NewReader("config 1\nmonitor 2\ngpu0/gi1/access 12\ngpu0/gi1/ci0/access 13\n"))
	require.NoError(t, err)
	assert.Equal(t, 12, m["gpu0/gi1/access"])
	_, err = ParseMigMinors(strings.NewReader("gpu0/gi1/access twelve\n"))
	require.ErrorContains(t, err, `line 1: minor "twelve"`)
}
