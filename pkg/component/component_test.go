package component

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"strings"
	"testing"

	"github.com/spf13/pflag"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	logsapi "k8s.io/component-base/logs/api/v1"
	"k8s.io/klog/v2"

	"github.com/gpudra/gpudra/internal/version"
	"github.com/gpudra/gpudra/pkg/features"
)

// envOf is a fake environment.
func envOf(vars map[string]string) func(string) (string, bool) {
	return func(k string) (string, bool) {
		v, ok := vars[k]
		return v, ok
	}
}

type testFlags struct {
	qps        float64
	burst      int
	fractional bool
	node       string
	xids       []uint64
}

func newTestComponent() (*Component, *testFlags) {
	c := New("test-component")
	f := &testFlags{}
	fs := c.Flags
	fs.Float64Var(&f.qps, "kube-api-qps", 100, "QPS")
	EnvVar(fs, "kube-api-qps", "KUBE_API_QPS")
	fs.IntVar(&f.burst, "kube-api-burst", 300, "burst")
	EnvVar(fs, "kube-api-burst", "KUBE_API_BURST")
	fs.BoolVar(&f.fractional, "fractional-gpus", false, "fractional")
	EnvVar(fs, "fractional-gpus", "FRACTIONAL_GPUS")
	fs.StringVar(&f.node, "node-name", "", "node")
	EnvVar(fs, "node-name", "NODE_NAME")
	Uint64ListVar(fs, &f.xids, "health-ignored-xids", []uint64{13, 31}, "XIDs")
	EnvVar(fs, "health-ignored-xids", "HEALTH_IGNORED_XIDS")
	return c, f
}

func TestParseFlagsAndEnvironment(t *testing.T) {
	defaults := testFlags{qps: 100, burst: 300, xids: []uint64{13, 31}}
	tests := []struct {
		name    string
		args    []string
		env     map[string]string
		want    testFlags
		wantErr []string // substrings of the error; empty: no error
	}{
		{name: "defaults", want: defaults},
		{name: "environment", env: map[string]string{"KUBE_API_QPS": "50.5", "KUBE_API_BURST": "60", "FRACTIONAL_GPUS": "true", "NODE_NAME": "n1", "HEALTH_IGNORED_XIDS": " 43, 45 "},
			want: testFlags{qps: 50.5, burst: 60, fractional: true, node: "n1", xids: []uint64{43, 45}}},
		{name: "an empty variable is unset", env: map[string]string{"KUBE_API_QPS": "", "HEALTH_IGNORED_XIDS": ""}, want: defaults},
		{name: "the command line wins over the environment", args: []string{"--kube-api-qps=7", "--node-name=flag"},
			env:  map[string]string{"KUBE_API_QPS": "fifty", "NODE_NAME": "env"},
			want: testFlags{qps: 7, burst: 300, node: "flag", xids: []uint64{13, 31}}},
		{name: "an empty list on the command line is no XIDs", args: []string{"--health-ignored-xids="}, env: map[string]string{"HEALTH_IGNORED_XIDS": "79"},
			want: testFlags{qps: 100, burst: 300, xids: []uint64{}}},
		{name: "a number that is not one", env: map[string]string{"KUBE_API_QPS": "fifty"},
			wantErr: []string{`environment variable KUBE_API_QPS="fifty" (--kube-api-qps): `, "invalid syntax"}},
		{name: "a float for an int", env: map[string]string{"KUBE_API_BURST": "300.0"},
			wantErr: []string{`environment variable KUBE_API_BURST="300.0" (--kube-api-burst)`}},
		{name: "a bool that is not one", env: map[string]string{"FRACTIONAL_GPUS": "yes"},
			wantErr: []string{`environment variable FRACTIONAL_GPUS="yes" (--fractional-gpus)`}},
		{name: "a bad XID", env: map[string]string{"HEALTH_IGNORED_XIDS": "13,x"},
			wantErr: []string{`environment variable HEALTH_IGNORED_XIDS="13,x" (--health-ignored-xids): "x" is not an unsigned integer`}},
		{name: "a negative XID", args: []string{"--health-ignored-xids=-1"},
			wantErr: []string{`"-1" is not an unsigned integer`}},
		{name: "every bad variable is reported", env: map[string]string{"KUBE_API_QPS": "fifty", "FRACTIONAL_GPUS": "yes"},
			wantErr: []string{"KUBE_API_QPS", "FRACTIONAL_GPUS"}},
		{name: "a positional argument", args: []string{"--node-name", "a", "b"}, wantErr: []string{`unexpected arguments ["b"]`}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c, got := newTestComponent()
			err := c.Parse(tc.args, envOf(tc.env))
			if len(tc.wantErr) > 0 {
				require.Error(t, err)
				for _, want := range tc.wantErr {
					assert.Contains(t, err.Error(), want)
				}
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want, *got)
		})
	}
}

func TestUsageNamesTheEnvironmentVariable(t *testing.T) {
	c, _ := newTestComponent()
	usage := c.Flags.FlagUsages()
	assert.Contains(t, usage, "QPS (env KUBE_API_QPS)")
	assert.Contains(t, usage, "XIDs (env HEALTH_IGNORED_XIDS) (default 13,31)")
	assert.Equal(t, "NODE_NAME", EnvOf(c.Flags, "node-name"))
	assert.Empty(t, EnvOf(c.Flags, "feature-gates"))
	assert.Panics(t, func() { EnvVar(c.Flags, "no-such-flag", "X") })
}

// The component's flags parse into what their libraries use.
func TestFeatureGateFlag(t *testing.T) {
	tests := []struct {
		value   string
		check   func(t *testing.T, c *Component)
		wantErr string
	}{
		{value: "MPSSharing=false,DynamicMIG=false", check: func(t *testing.T, c *Component) {
			assert.False(t, c.Features.Enabled(features.MPSSharing))
			assert.False(t, c.Features.Enabled(features.DynamicMIG))
			assert.True(t, c.Features.Enabled(features.TimeSlicing))
			assert.NotContains(t, c.EnabledGates(), "MPSSharing")
			assert.Contains(t, c.EnabledGates(), "TimeSlicing")
		}},
		{value: "ContextualLogging=false", check: func(t *testing.T, c *Component) {
			assert.NotContains(t, c.EnabledGates(), "ContextualLogging")
		}},
		{value: "NoSuchGate=true", wantErr: "unrecognized feature gate: NoSuchGate"},
		{value: "MPSSharing=maybe", wantErr: "invalid value of MPSSharing=maybe"},
	}
	for _, tc := range tests {
		t.Run(tc.value, func(t *testing.T) {
			c, _ := newTestComponent()
			err := c.Parse([]string{"--feature-gates=" + tc.value}, envOf(nil))
			if tc.wantErr != "" {
				require.Error(t, err)
				assert.Contains(t, err.Error(), tc.wantErr)
				return
			}
			require.NoError(t, err)
			tc.check(t, c)
		})
	}
}

func execute(t *testing.T, args []string, env map[string]string, run func(ctx context.Context) error) (code int, stdout, stderr string) {
	t.Helper()
	// Logging is global: put it back for the next test.
	t.Cleanup(func() { require.NoError(t, logsapi.ResetForTest(nil)) })
	c, _ := newTestComponent()
	var out, errOut bytes.Buffer
	code = c.Execute(context.Background(), args, IO{Stdout: &out, Stderr: &errOut, LookupEnv: envOf(env)}, run)
	klog.Flush()
	return code, out.String(), errOut.String()
}

func TestExecute(t *testing.T) {
	oldVersion, oldCommit := version.Version, version.Commit
	version.Version, version.Commit = "v9.9.9", "0123abc"
	t.Cleanup(func() { version.Version, version.Commit = oldVersion, oldCommit })

	ran := false
	run := func(ctx context.Context) error {
		ran = true
		klog.FromContext(ctx).Info("Hello", "answer", 42)
		return errors.New("no GPUs")
	}

	t.Run("--version prints and exits", func(t *testing.T) {
		ran = false
		code, stdout, stderr := execute(t, []string{"--version"}, nil, run)
		assert.Equal(t, ExitOK, code)
		assert.Regexp(t, `^test-component v9\.9\.9 \(commit 0123abc, go[0-9.]+\S* \w+/\w+\)\n$`, stdout)
		assert.Empty(t, stderr)
		assert.False(t, ran, "--version runs nothing")
	})

	t.Run("--logging-format=json writes JSON lines", func(t *testing.T) {
		code, stdout, stderr := execute(t, []string{"--logging-format=json", "-v=1"}, nil, run)
		assert.Equal(t, ExitFailed, code)
		assert.Empty(t, stdout)
		lines := strings.Split(strings.TrimSpace(stderr), "\n")
		require.Len(t, lines, 3, stderr)
		var msgs []map[string]any
		for _, line := range lines {
			var m map[string]any
			require.NoError(t, json.Unmarshal([]byte(line), &m), "not JSON: %s", line)
			msgs = append(msgs, m)
		}
		assert.Equal(t, "Starting test-component", msgs[0]["msg"])
		assert.Equal(t, "v9.9.9", msgs[0]["version"])
		assert.Equal(t, "0123abc", msgs[0]["commit"])
		assert.Contains(t, msgs[0]["featureGates"], "MPSSharing")
		assert.Equal(t, "Hello", msgs[1]["msg"])
		assert.EqualValues(t, 42, msgs[1]["answer"])
		assert.Equal(t, "test-component failed", msgs[2]["msg"])
		assert.Equal(t, "no GPUs", msgs[2]["err"])
	})

	t.Run("text is the default", func(t *testing.T) {
		code, _, stderr := execute(t, nil, nil, run)
		assert.Equal(t, ExitFailed, code)
		assert.Contains(t, stderr, `"Starting test-component" version="v9.9.9" commit="0123abc"`)
		assert.Contains(t, stderr, `"test-component failed" err="no GPUs"`)
		assert.False(t, json.Valid([]byte(strings.SplitN(stderr, "\n", 2)[0])))
	})

	for _, tc := range []struct {
		name string
		args []string
		env  map[string]string
		want string
	}{
		{"an unknown feature gate", []string{"--feature-gates=NoSuchGate=true"}, nil, "unrecognized feature gate: NoSuchGate"},
		{"an unknown log format", []string{"--logging-format=xml"}, nil, `logging: format: Invalid value: "xml"`},
		{"a bad environment variable", nil, map[string]string{"KUBE_API_QPS": "fifty"}, `environment variable KUBE_API_QPS="fifty"`},
		{"an unknown flag", []string{"--no-such-flag"}, nil, "unknown flag: --no-such-flag"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ran = false
			code, _, stderr := execute(t, tc.args, tc.env, run)
			assert.Equal(t, ExitBadArgs, code)
			assert.Contains(t, stderr, "test-component: ")
			assert.Contains(t, stderr, tc.want)
			assert.False(t, ran, "nothing runs with bad arguments")
		})
	}

	t.Run("--help", func(t *testing.T) {
		ran = false
		code, _, stderr := execute(t, []string{"--help"}, nil, run)
		assert.Equal(t, ExitOK, code)
		for _, want := range []string{"--logging-format", "--feature-gates", "MPSSharing=true|false (BETA - default=true)", "--version", "-v, --v", "(env KUBE_API_QPS)"} {
			assert.Contains(t, stderr, want)
		}
		assert.False(t, ran)
	})
}

// New registers nothing on the process's global flag sets: devcluster links
// the plugin into a process where klog's flags are registered already.
func TestNoGlobalFlags(t *testing.T) {
	goFlags := func() int {
		n := 0
		flag.VisitAll(func(*flag.Flag) { n++ })
		return n
	}
	before, beforeGo := countFlags(pflag.CommandLine), goFlags()
	New("a")
	New("b")
	assert.Equal(t, before, countFlags(pflag.CommandLine))
	assert.Equal(t, beforeGo, goFlags())
}

func countFlags(fs *pflag.FlagSet) int {
	n := 0
	fs.VisitAll(func(*pflag.Flag) { n++ })
	return n
}
