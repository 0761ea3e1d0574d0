package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/gpudra/gpudra/pkg/component"
	"github.com/gpudra/gpudra/pkg/mpsserver"
)

// The binary as the Makefile builds it (version and commit through
// -ldflags), run as a process: what the container runs.
func TestBinary(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	bin := filepath.Join(t.TempDir(), "gpudra-mps-server")
	build := exec.Command(filepath.Join(runtime.GOROOT(), "bin", "go"), "build", "-o", bin,
		"-ldflags", "-X github.com/gpudra/gpudra/internal/version.Version=v9.9.9 -X github.com/gpudra/gpudra/internal/version.Commit=0123abc", ".")
	out, err := build.CombinedOutput()
	require.NoError(t, err, "%s", out)

	tests := []struct {
		name     string
		args     []string
		wantCode int
		check    func(t *testing.T, stdout, stderr string)
	}{
		{name: "--version", args: []string{"--version"}, check: func(t *testing.T, stdout, stderr string) {
			assert.Regexp(t, `^gpudra-mps-server v9\.9\.9 \(commit 0123abc, go\S+ \w+/\w+\)\n$`, stdout)
			assert.Empty(t, stderr)
		}},
		{name: "JSON logs", args: []string{"--logging-format=json", "--devices=GPU-a"}, wantCode: 1, check: func(t *testing.T, stdout, stderr string) {
			lines := strings.Split(strings.TrimSpace(stderr), "\n")
			require.Len(t, lines, 2, stderr)
			var start, failed map[string]any
			require.NoError(t, json.Unmarshal([]byte(lines[0]), &start), lines[0])
			require.NoError(t, json.Unmarshal([]byte(lines[1]), &failed), lines[1])
			assert.Equal(t, "Starting gpudra-mps-server", start["msg"])
			assert.Equal(t, "v9.9.9", start["version"])
			assert.Equal(t, "0123abc", start["commit"])
			assert.Equal(t, runtime.Version(), start["goVersion"])
			assert.Equal(t, "gpudra-mps-server failed", failed["msg"])
			assert.Equal(t, "--dir: required", failed["err"])
		}},
		{name: "an unknown feature gate", args: []string{"--feature-gates=NoSuchGate=true"}, wantCode: 2, check: func(t *testing.T, stdout, stderr string) {
			assert.Contains(t, stderr, "gpudra-mps-server: invalid argument \"NoSuchGate=true\" for \"--feature-gates\" flag: unrecognized feature gate: NoSuchGate")
		}},
		{name: "a single-dash long flag", args: []string{"-dir=/x"}, wantCode: 2, check: func(t *testing.T, stdout, stderr string) {
			assert.Contains(t, stderr, "gpudra-mps-server: ")
		}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cmd := exec.Command(bin, tc.args...)
			var stdout, stderr bytes.Buffer
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			err := cmd.Run()
			code := 0
			var exit *exec.ExitError
			if errors.As(err, &exit) {
				code = exit.ExitCode()
			} else {
				require.NoError(t, err)
			}
			assert.Equal(t, tc.wantCode, code, "stderr: %s", stderr.String())
			tc.check(t, stdout.String(), stderr.String())
		})
	}
}

// The arguments the kubelet plugin gives an MPS server pod
// (pkg/sharing.PodServers) parse, logging flags included.
func TestPodArguments(t *testing.T) {
	c := component.New("gpudra-mps-server")
	cfg := mpsserver.AddFlags(c.Flags)
	noEnv := func(string) (string, bool) { return "", false }
	require.NoError(t, c.Parse([]string{"--driver-root=/driver-root", "--dir=/var/lib/mps/a", "--devices=GPU-a,GPU-b", "-v=0",
		"--control-binary=/driver-root/usr/bin/nvidia-cuda-mps-control", "--logging-format=json"}, noEnv))
	assert.Equal(t, "/driver-root", cfg.Tools.Root)
	assert.Equal(t, "/var/lib/mps/a", cfg.Dir)
	assert.Equal(t, []string{"GPU-a", "GPU-b"}, cfg.Devices)
	assert.Equal(t, "/driver-root/usr/bin/nvidia-cuda-mps-control", cfg.ControlBinary)
	assert.Equal(t, "json", c.Logging.Format)
}
