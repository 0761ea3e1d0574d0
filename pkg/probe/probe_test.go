package probe

import (
	"bytes"
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestRunExits: the probe runs until stopped, unless told to exit (at once,
// or after a while: a job's container that completes); exiting, a command
// that failed fails it.
func TestRunExits(t *testing.T) {
	for _, tc := range []struct {
		name    string
		cfg     Config
		stopped bool // runs until ctx ends
		minTime time.Duration
		wantErr string
	}{
		{name: "runs until stopped", stopped: true},
		{name: "--exit", cfg: Config{Exit: true}},
		{name: "--exit-after", cfg: Config{ExitAfter: 300 * time.Millisecond}, minTime: 300 * time.Millisecond},
		{name: "--exit-after, its command failed", cfg: Config{ExitAfter: time.Millisecond, Exec: []string{"false"}},
			wantErr: `command ["false"] exited with 1`},
		{name: "--exit, its command succeeded", cfg: Config{Exit: true, Exec: []string{"true"}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
			defer cancel()
			var out bytes.Buffer
			tc.cfg.Out = &out
			start := time.Now()
			err := Run(ctx, tc.cfg)
			if tc.wantErr != "" {
				assert.EqualError(t, err, tc.wantErr)
			} else {
				require.NoError(t, err)
			}
			assert.Equal(t, tc.stopped, ctx.Err() != nil, "ran until stopped")
			assert.GreaterOrEqual(t, time.Since(start), tc.minTime)
			assert.Contains(t, out.String(), `"devices"`, "it reported first")
		})
	}
}
