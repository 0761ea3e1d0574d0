package plugin

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// deviceTaints lists the devices of what the driver would publish now that
// have a taint, with the taint's value.
func deviceTaints(ctx context.Context, d *Driver) (map[string]string, error) {
	res, _, err := d.Resources(ctx)
	if err != nil {
		return nil, err
	}
	out := map[string]string{}
	for _, s := range res.Pools[pool].Slices {
		for _, dev := range s.Devices {
			if len(dev.Taints) > 0 {
				out[dev.Name] = dev.Taints[0].Value
			}
		}
	}
	return out, nil
}

// A publish after a health change that fails (the publish itself, or the
// NVML read it starts with) is retried until one succeeds: the taint of a
// GPU that went bad at that moment is published, not lost until something
// unrelated changes.
func TestRepublishIsRetriedUntilItSucceeds(t *testing.T) {
	for _, tc := range []struct {
		name string
		// publishFails: the first publishes fail; readFails: the first
		// GPU reads fail (the simulator's FailInventory).
		publishFails, readFails int
	}{
		{name: "a publish that fails once", publishFails: 1},
		{name: "NVML reads that fail three times", readFails: 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t)
			d := &Driver{state: e.start(), backend: e.machine, pool: pool}
			var calls atomic.Int32
			published := make(chan map[string]string, 10)
			d.publish = func(ctx context.Context) error {
				if int(calls.Add(1)) <= tc.publishFails {
					return errors.New("injected: the API server is away")
				}
				taints, err := deviceTaints(ctx, d)
				if err != nil {
					return err
				}
				published <- taints
				return nil
			}
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			d.startRepublishing(ctx)
			defer d.stopRepublishing()
			require.NoError(t, d.watchHealth(ctx))

			gpu := inventory(t, e.machine).GPUs[4].UUID
			e.machine.FailInventory(tc.readFails)
			require.NoError(t, e.machine.InjectXID(gpu, "", 48))
			select {
			case taints := <-published:
				assert.Equal(t, map[string]string{"gpu-4": "xid-48"}, taints, "the taint is published after the retries")
			case <-time.After(15 * time.Second):
				t.Fatalf("the taint was never published: %d publishes, %d failed reads", calls.Load(), e.machine.InventoryFailures())
			}
			assert.Equal(t, int32(tc.publishFails+tc.readFails+1), calls.Load(), "one publish per failure, then the one that worked")
			assert.Equal(t, tc.readFails, e.machine.InventoryFailures())
			select {
			case taints := <-published:
				t.Fatalf("published again after success: %v", taints)
			case <-time.After(100 * time.Millisecond):
			}
		})
	}
}

// Republishes asked for while a publish runs fold into one more publish:
// the queue holds its one key once.
func TestRepublishesFoldIntoOne(t *testing.T) {
	e := newEnv(t)
	d := &Driver{state: e.start(), backend: e.machine, pool: pool}
	var calls atomic.Int32
	running, release := make(chan struct{}), make(chan struct{})
	d.publish = func(ctx context.Context) error {
		if calls.Add(1) == 1 {
			close(running)
			<-release
		}
		return nil
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	d.startRepublishing(ctx)
	d.republish(ctx)
	<-running
	for range 5 {
		d.republish(ctx)
	}
	close(release)
	require.Eventually(t, func() bool { return calls.Load() == 2 }, 5*time.Second, 10*time.Millisecond)
	time.Sleep(100 * time.Millisecond)
	assert.Equal(t, int32(2), calls.Load(), "five asks during the first publish made one more")

	d.stopRepublishing()
	d.republish(ctx)
	time.Sleep(50 * time.Millisecond)
	assert.Equal(t, int32(2), calls.Load(), "nothing is published after stopRepublishing")
}
