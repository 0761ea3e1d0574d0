package v1alpha1

import (
	"encoding/json"
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
			wantErr: `invalid GpuConfig: sharing.strategy: Unsupported value: "Fast": supported values: "Exclusive", "TimeSlicing", "MPS"`},
		{name: "mps", raw: `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mps":{"activeThreadPercentage":50,"pinnedMemoryLimit":"40Gi"}}}`, want: MPS},
		{name: "time slicing", raw: `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"TimeSlicing","timeSlicing":{"interval":"Long"}}}`, want: TimeSlicing},
		{name: "ipc with exclusive", raw: `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"ipc":true}}`, want: Exclusive},
		{name: "mps limits on a time-sliced device", raw: `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"TimeSlicing","mps":{"activeThreadPercentage":50}}}`,
			wantErr: `invalid GpuConfig: sharing.mps: Forbidden: only with strategy MPS, not TimeSlicing: MPS limits mean nothing without an MPS daemon`},
		{name: "time slice on exclusive", raw: `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"timeSlicing":{"interval":"Short"}}}`,
			wantErr: `invalid GpuConfig: sharing.timeSlicing: Forbidden: only with strategy TimeSlicing, not Exclusive`},
		{name: "unknown interval", raw: `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"TimeSlicing","timeSlicing":{"interval":"Forever"}}}`,
			wantErr: `invalid GpuConfig: sharing.timeSlicing.interval: Unsupported value: "Forever": supported values: "Default", "Short", "Medium", "Long"`},
		{name: "thread percentage out of range", raw: `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mps":{"activeThreadPercentage":0}}}`,
			wantErr: `invalid GpuConfig: sharing.mps.activeThreadPercentage: Invalid value: 0: must be between 1 and 100`},
		{name: "negative memory limit", raw: `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mps":{"pinnedMemoryLimit":"-1Gi"}}}`,
			wantErr: `invalid GpuConfig: sharing.mps.pinnedMemoryLimit: Invalid value: "-1Gi": must be positive`},
		{name: "memory limit not a quantity", raw: `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mps":{"pinnedMemoryLimit":"lots"}}}`,
			wantErr: `decode GpuConfig: quantities must match the regular expression '^([+-]?[0-9.]+)([eEinumkKMGTP]*[-+]?[0-9]*)$'`},
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

func TestValidateForDevice(t *testing.T) {
	h100 := DeviceFacts{Name: "gpu-0", MemoryBytes: 81559 << 20}
	tests := []struct {
		name    string
		raw     string
		wantErr string
	}{
		{name: "limit within the device", raw: `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mps":{"pinnedMemoryLimit":"40Gi"}}}`},
		{name: "limit equal to the device", raw: `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mps":{"pinnedMemoryLimit":"81559Mi"}}}`},
		{name: "limit above the device", raw: `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":{"strategy":"MPS","mps":{"pinnedMemoryLimit":"80Gi"}}}`,
			wantErr: `invalid GpuConfig: sharing.mps.pinnedMemoryLimit: Invalid value: "80Gi": exceeds the memory of device gpu-0 (81559Mi)`},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			c, err := Decode([]byte(tc.raw))
			require.NoError(t, err)
			err = c.ValidateForDevice(h100)
			if tc.wantErr == "" {
				assert.NoError(t, err)
				return
			}
			require.Error(t, err)
			assert.Equal(t, tc.wantErr, err.Error())
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
		if err == nil && (c == nil || c.Sharing == nil || c.Sharing.Strategy == "" ||
			(c.Sharing.Strategy == TimeSlicing && c.Sharing.TimeSlicing == nil) || (c.Sharing.Strategy == MPS && c.Sharing.MPS == nil)) {
			t.Fatalf("accepted config is not defaulted: %+v", c)
		}
	})
}

// A share of a GPU may not change what belongs to the whole GPU, nor ask for
// more than it was given.
func TestValidateForShare(t *testing.T) {
	// A 20Gi share with 33 of an H100's 132 SMs: 25%.
	share := ShareBounds{Device: "gpu-5", MemoryBytes: 20 << 30, Multiprocessors: 33, GPUMultiprocessors: 132}
	const head = `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig","sharing":`
	tests := []struct {
		name    string
		bounds  ShareBounds
		raw     string
		wantErr []string
		// static: the static part (what the webhook checks) already fails.
		static bool
	}{
		{name: "no config", bounds: share, raw: `{"apiVersion":"gpu.gpudra.dev/v1alpha1","kind":"GpuConfig"}`},
		{name: "mps within the share", bounds: share, raw: head + `{"strategy":"MPS","mps":{"activeThreadPercentage":25,"pinnedMemoryLimit":"20Gi"}}}`},
		{name: "ipc", bounds: share, raw: head + `{"ipc":true}}`},
		{name: "time slicing", bounds: share, raw: head + `{"strategy":"TimeSlicing","timeSlicing":{"interval":"Long"}}}`,
			wantErr: []string{`sharing.strategy: Forbidden: TimeSlicing is not allowed on a share of device gpu-5`}},
		{name: "thread percentage above the share", bounds: share, raw: head + `{"strategy":"MPS","mps":{"activeThreadPercentage":26}}}`,
			wantErr: []string{`sharing.mps.activeThreadPercentage: Invalid value: 26: exceeds the share of device gpu-5 (33 of 132 multiprocessors: at most 25)`}},
		{name: "pinned memory above the share", bounds: share, raw: head + `{"strategy":"MPS","mps":{"pinnedMemoryLimit":"21Gi"}}}`,
			wantErr: []string{`sharing.mps.pinnedMemoryLimit: Invalid value: "21Gi": exceeds the share of device gpu-5 (20480Mi)`}},
		{name: "both limits above the share", bounds: share, raw: head + `{"strategy":"MPS","mps":{"activeThreadPercentage":100,"pinnedMemoryLimit":"80Gi"}}}`,
			wantErr: []string{"sharing.mps.activeThreadPercentage: Invalid value: 100", `sharing.mps.pinnedMemoryLimit: Invalid value: "80Gi"`}},
		{name: "a share without multiprocessors has no compute bound", bounds: ShareBounds{Device: "gpu-5", MemoryBytes: 20 << 30, GPUMultiprocessors: 132},
			raw: head + `{"strategy":"MPS","mps":{"activeThreadPercentage":100}}}`},
		{name: "static errors are still reported", bounds: share, raw: head + `{"strategy":"MPS","mps":{"activeThreadPercentage":0}}}`, static: true,
			wantErr: []string{`sharing.mps.activeThreadPercentage: Invalid value: 0: must be between 1 and 100`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// The static part passes where only the share is exceeded: the
			// webhook, which knows no share, accepts these configs.
			var cfg GpuConfig
			require.NoError(t, json.Unmarshal([]byte(tt.raw), &cfg))
			if tt.static {
				assert.Error(t, cfg.Validate())
			} else {
				assert.NoError(t, cfg.Validate())
			}
			err := cfg.ValidateForShare(tt.bounds)
			if len(tt.wantErr) == 0 {
				assert.NoError(t, err)
				return
			}
			require.Error(t, err)
			for _, w := range tt.wantErr {
				assert.Contains(t, err.Error(), w)
			}
		})
	}
}
