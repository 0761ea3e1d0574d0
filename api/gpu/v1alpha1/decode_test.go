package v1alpha1

import (
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestDecode(t *testing.T) {
	tests := []struct {
		name    string
		raw     string
		want    SharingStrategy
		wantErr string
	}{
		{name: "empty config is exclusive", raw: `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig"}`, want: Exclusive},
		{name: "explicit exclusive", raw: `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"Exclusive"}}`, want: Exclusive},
		{name: "unknown field", raw: `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"Exclusive","slices":2}}`,
			wantErr: `decode GpuConfig: unknown field "sharing.slices"`},
		{name: "duplicate field", raw: `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","kind":"GpuConfig"}`,
			wantErr: `decode GpuConfig: duplicate field "kind"`},
		{name: "wrong kind", raw: `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"MigConfig"}`,
			wantErr: `invalid GpuConfig: kind: Invalid value: "MigConfig": must be GpuConfig`},
		{name: "wrong version", raw: `{"apiVersion":"gpu.gpudra.dev/v1","kind":"GpuConfig"}`,
			wantErr: `invalid GpuConfig: apiVersion: Invalid value: "gpu.gpudra.dev/v1": must be gpu.gpudra.dev/v1alpha1`},
		{name: "unknown strategy", raw: `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"Fast"}}`,
			wantErr: `invalid GpuConfig: sharing.strategy: Unsupported value: "Fast": supported values: "Exclusive"`},
		{name: "not yet supported strategy", raw: `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS"}}`,
			wantErr: `invalid GpuConfig: sharing.strategy: Unsupported value: "MPS": supported values: "Exclusive"`},
		{name: "wrong type", raw: `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":"yes"}`,
			wantErr: `decode GpuConfig: json: cannot unmarshal string into Go struct field GpuConfig.sharing of type v1alpha1.Sharing`},
		{name: "not json", raw: `sharing: {}`, wantErr: "decode GpuConfig: invalid character 's' looking for beginning of value"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Decode([]byte(tc.raw))
			if tc.wantErr != "" {
				require.Error(t, err)
				assert.Equal(t, tc.wantErr, firstLine(err.Error()))
				return
			}
			require.NoError(t, err)
			assert.Equal(t, tc.want, c.Sharing.Strategy)
		})
	}
}

func firstLine(s string) string {
	for i, c := range s {
		if c == '\n' {
			return s[:i]
		}
	}
	return s
}

func FuzzDecode(f *testing.F) {
	f.Add([]byte(`{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"Exclusive"}}`))
	f.Add([]byte(`{"kind":"GpuConfig","sharing":null}`))
	f.Fuzz(func(t *testing.T, raw []byte) {
		c, err := Decode(raw)
		if err == nil && (c == nil || c.Sharing == nil || c.Sharing.Strategy != Exclusive) {
			t.Fatalf("accepted config is not defaulted: %+v", c)
		}
	})
}
