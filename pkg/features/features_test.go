package features

import (
	"encoding/json"
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"k8s.io/component-base/featuregate"
	logsapi "k8s.io/component-base/logs/api/v1"
)

func TestSetGates(t *testing.T) {
	tests := []struct {
		value   string
		want    map[featuregate.Feature]bool
		wantErr string
	}{
		{value: "", want: map[featuregate.Feature]bool{MPSSharing: true, TimeSlicing: true, FractionalGPUs: true, DynamicMIG: true, DeviceHealth: true}},
		{value: "MPSSharing=false, DeviceHealth=false", want: map[featuregate.Feature]bool{MPSSharing: false, TimeSlicing: true, FractionalGPUs: true, DynamicMIG: true, DeviceHealth: false}},
		{value: "AllBeta=false", want: map[featuregate.Feature]bool{MPSSharing: false, TimeSlicing: false, FractionalGPUs: false, DynamicMIG: false, DeviceHealth: false}},
		{value: "NoSuchGate=true", wantErr: "unrecognized feature gate: NoSuchGate"},
		{value: "MPSSharing", wantErr: "missing bool value for MPSSharing"},
		{value: "TimeSlicing=on", wantErr: "invalid value of TimeSlicing=on"},
	}
	for _, tc := range tests {
		t.Run(tc.value, func(t *testing.T) {
			g := New()
			err := g.Set(tc.value)
			if tc.wantErr != "" {
				require.Error(t, err)
				assert.Contains(t, err.Error(), tc.wantErr)
				return
			}
			require.NoError(t, err)
			for f, want := range tc.want {
				assert.Equal(t, want, g.Enabled(f), f)
				assert.Equal(t, want, Enabled(g, f), f)
				if want {
					assert.NoError(t, Require(g, f))
				} else {
					assert.EqualError(t, Require(g, f), fmt.Sprintf("feature gate %s is disabled (--feature-gates=%s=true turns it on)", f, f))
				}
			}
		})
	}
}

// A nil gate is every gate at its default: what devcluster's in-process
// plugins, which have no flags, get.
func TestNilGateIsTheDefaults(t *testing.T) {
	g := New()
	require.NotEmpty(t, All())
	for _, f := range All() {
		spec, ok := Spec(f)
		require.True(t, ok, f)
		assert.Equal(t, spec.Default, Enabled(nil, f), f)
		assert.Equal(t, spec.Default, g.Enabled(f), f)
		// Beta and GA gates are on by default, Alpha gates off.
		assert.Equal(t, spec.PreRelease != featuregate.Alpha, spec.Default, "%s is %s", f, spec.PreRelease)
	}
}

// docs/feature-gates.md has a row for every gate with its maturity and
// default, and no row for a gate that does not exist.
func TestDocumented(t *testing.T) {
	b, err := os.ReadFile("../../docs/feature-gates.md")
	require.NoError(t, err)
	doc := string(b)
	documented := map[string]bool{}
	for _, line := range strings.Split(doc, "\n") {
		if cells := strings.Split(line, "|"); len(cells) > 4 && strings.HasPrefix(strings.TrimSpace(cells[1]), "`") {
			documented[strings.Trim(strings.TrimSpace(cells[1]), "`")] = true
		}
	}
	for _, f := range All() {
		spec, _ := Spec(f)
		row := fmt.Sprintf("| `%s` | %s | %t |", f, strings.ToUpper(string(spec.PreRelease)[:1])+strings.ToLower(string(spec.PreRelease)[1:]), spec.Default)
		assert.Contains(t, doc, row, "docs/feature-gates.md lacks the row of %s", f)
		delete(documented, string(f))
	}
	assert.Empty(t, documented, "docs/feature-gates.md documents gates that do not exist")
}

// The chart's values schema knows every gate a binary takes (gpudra's and
// component-base's logging gates), and no other: a misspelt gate fails
// `helm install`, naming it.
func TestChartSchemaKnowsEveryGate(t *testing.T) {
	b, err := os.ReadFile("../../deployments/helm/gpudra/values.schema.json")
	require.NoError(t, err)
	var schema struct {
		Properties struct {
			FeatureGates struct {
				AdditionalProperties bool                       `json:"additionalProperties"`
				Properties           map[string]json.RawMessage `json:"properties"`
			} `json:"featureGates"`
		} `json:"properties"`
	}
	require.NoError(t, json.Unmarshal(b, &schema))
	g := New()
	require.NoError(t, logsapi.AddFeatureGates(g))
	var want []string
	for f := range g.GetAll() {
		want = append(want, string(f))
	}
	assert.ElementsMatch(t, want, slices.Collect(maps.Keys(schema.Properties.FeatureGates.Properties)))
	assert.False(t, schema.Properties.FeatureGates.AdditionalProperties)
}
