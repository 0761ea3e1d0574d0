package dashboard

import "github.com/gpudra/gpudra/pkg/top"

// A device's usage on the page, and whether a held one is idle.

// idleClaimed: held, and every reading the source has of what is held
// says nothing ran. A GPU in MIG mode has no utilization reading: its
// held MIG devices' SM activity tells. No reading at all is not idle.
func idleClaimed(g GPU, whole bool, held []Placement) bool {
	if whole {
		return idleReading(g.Usage, func(u *Usage) *float64 { return u.Utilization })
	}
	if len(held) == 0 {
		return false
	}
	for _, p := range g.Placements {
		if p.State == StateAllocated && !idleReading(p.Usage, func(u *Usage) *float64 { return u.SMActive }) {
			return false
		}
	}
	return true
}

// idleReading: the reading is 0 now, and every point of the sparkline that was
// read is 0 too.
func idleReading(u *Usage, reading func(*Usage) *float64) bool {
	if u == nil || reading(u) == nil || *reading(u) != 0 {
		return false
	}
	for _, p := range u.Spark {
		if p != nil && *p != 0 {
			return false
		}
	}
	return true
}

// usage is a device's usage from its node's last read, nil when none was
// read (the page shows "not read", not 0).
func (b *builder) usage(node, device string, snap map[string]*top.Device) *Usage {
	d := snap[device]
	spark := b.in.Spark[SparkKey(node, device)]
	if d == nil && len(spark) == 0 {
		return nil
	}
	u := &Usage{Spark: spark}
	if d != nil {
		u.Utilization, u.SMActive, u.MemoryUsedBytes, u.MemoryTotalBytes, u.PowerWatts =
			d.Utilization, d.SMActive, d.MemoryUsedBytes, d.MemoryTotalBytes, d.PowerWatts
	}
	return u
}
