package nodeagent

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	v1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

func TestParseSimLoad(t *testing.T) {
	const gi = 1 << 30
	for _, tc := range []struct {
		value   string
		want    SimLoad
		wantErr string
	}{
		{value: "sm=0.4,memory=20Gi", want: SimLoad{SMShare: 0.4, MemoryBytes: 20 * gi}},
		{value: "memory=512Mi,sm=1", want: SimLoad{SMShare: 1, MemoryBytes: 512 << 20}},
		{value: "sm=0", want: SimLoad{}},
		{value: "memory=1e9", want: SimLoad{MemoryBytes: 1e9}},
		{value: "sm=0.25", want: SimLoad{SMShare: 0.25}},
		{value: "", wantErr: "empty"},
		{value: "sm=1.5", wantErr: "sm=1.5: want a share of the device's SMs from 0 to 1"},
		{value: "sm=-0.1", wantErr: "from 0 to 1"},
		{value: "sm=NaN", wantErr: "from 0 to 1"},
		{value: "sm=40%", wantErr: "from 0 to 1"},
		{value: "memory=-1Gi", wantErr: "whole, non-negative number of bytes"},
		{value: "memory=0.5", wantErr: "whole, non-negative number of bytes"},
		{value: "memory=20GB", wantErr: "memory=20GB"},
		{value: "sm=0.4,sm=0.5", wantErr: `"sm" given twice`},
		{value: "sm=0.4,", wantErr: `"": want key=value`},
		{value: "sm=0.4, memory=1Gi", wantErr: `unknown key " memory"`},
		{value: "gpu=1", wantErr: `unknown key "gpu"`},
		{value: "sm", wantErr: `"sm": want key=value`},
		{value: "sm=", wantErr: `"sm=": want key=value`},
	} {
		t.Run(tc.value, func(t *testing.T) {
			got, err := ParseSimLoad(tc.value)
			if tc.wantErr != "" {
				require.Error(t, err)
				assert.Contains(t, err.Error(), tc.wantErr)
				assert.Zero(t, got, "no load from a malformed value")
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want, got)
		})
	}
}

func TestPodSimLoads(t *testing.T) {
	pod := func(containers ...v1.Container) *v1.Pod {
		return &v1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "ns", Name: "p"}, Spec: v1.PodSpec{Containers: containers}}
	}
	env := func(pairs ...string) []v1.EnvVar {
		var out []v1.EnvVar
		for i := 0; i < len(pairs); i += 2 {
			out = append(out, v1.EnvVar{Name: pairs[i], Value: pairs[i+1]})
		}
		return out
	}
	for _, tc := range []struct {
		name    string
		pod     *v1.Pod
		want    map[string]SimLoad
		wantBad string
		wantErr string
	}{
		{name: "none", pod: pod(v1.Container{Name: "a", Env: env("OTHER", "sm=1")}), want: map[string]SimLoad{}},
		{name: "per container", pod: pod(v1.Container{Name: "a", Env: env(SimLoadEnv, "sm=0.5")}, v1.Container{Name: "b"},
			v1.Container{Name: "c", Env: env(SimLoadEnv, "memory=1Ki")}),
			want: map[string]SimLoad{"a": {SMShare: 0.5}, "c": {MemoryBytes: 1024}}},
		{name: "the last entry wins, as in the container's environment",
			pod:  pod(v1.Container{Name: "a", Env: env(SimLoadEnv, "sm=0.1", SimLoadEnv, "sm=0.2")}),
			want: map[string]SimLoad{"a": {SMShare: 0.2}}},
		{name: "malformed names the pod and the container", pod: pod(v1.Container{Name: "a", Env: env(SimLoadEnv, "sm=0.5")},
			v1.Container{Name: "b", Env: env(SimLoadEnv, "sm=2")}),
			wantBad: "b", wantErr: `pod ns/p container b: GPUDRA_SIM_LOAD="sm=2": sm=2: want a share`},
		{name: "valueFrom", pod: pod(v1.Container{Name: "a", Env: []v1.EnvVar{{Name: SimLoadEnv,
			ValueFrom: &v1.EnvVarSource{FieldRef: &v1.ObjectFieldSelector{FieldPath: "metadata.name"}}}}}),
			wantBad: "a", wantErr: "pod ns/p container a: GPUDRA_SIM_LOAD must be a literal value"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, bad, err := podSimLoads(tc.pod)
			if tc.wantErr != "" {
				require.Error(t, err)
				assert.Contains(t, err.Error(), tc.wantErr)
				assert.Equal(t, tc.wantBad, bad)
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want, got)
		})
	}
}
