package top

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"
)

// JSON writes the snapshot as one line of JSON: a refreshing top writes
// one line per refresh, which a program reads line by line.
func JSON(w io.Writer, s *Snapshot) error {
	if err := json.NewEncoder(w).Encode(s); err != nil {
		return fmt.Errorf("write the snapshot as JSON: %w", err)
	}
	return nil
}

// Table writes the snapshot for a person: a heading, one row per device
// with its processes under it, the local waiters and the notes. A reading
// that could not be told is "-".
func Table(w io.Writer, s *Snapshot) error {
	node := s.Node
	if node == "" {
		node = "(node not known)"
	}
	fmt.Fprintf(w, "%s  %s  %s\n", node, s.Source, s.At.Format(time.TimeOnly))
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "DEVICE\tPROFILE\tHOLDER\tUTIL\tSM-ACTIVE\tMEMORY\tPOWER\tTEMP")
	for _, d := range s.Devices {
		profile := d.Profile
		if profile == "" {
			profile = "gpu"
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", d.Name, profile, holders(d), percent(d.Utilization), percent(d.SMActive),
			memory(d.MemoryUsedBytes, d.MemoryTotalBytes), unit(d.PowerWatts, "W"), unit(d.TemperatureC, "C"))
		for _, p := range d.Processes {
			fmt.Fprintf(tw, "  %s\t\t%s\t%s\t\t%s\t\t\n", processName(p), processOwner(p), smOf(p), memory(p.MemoryBytes, nil))
		}
	}
	if err := tw.Flush(); err != nil {
		return fmt.Errorf("write the table: %w", err)
	}
	if len(s.Waiting) > 0 {
		fmt.Fprintln(w, "\nWAITING (gpudra local)")
		tw = tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "NAME\tUSER\tQUEUED\tERROR")
		for _, wt := range s.Waiting {
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", wt.Name, wt.User, wt.QueuedAt.Format(time.DateTime), wt.Error)
		}
		if err := tw.Flush(); err != nil {
			return fmt.Errorf("write the table: %w", err)
		}
	}
	for _, n := range s.Notes {
		fmt.Fprintln(w, "note: "+n)
	}
	return nil
}

// holders says who holds a device: claims with their pods, local
// allocations with their users, "free", or "-" when the source cannot
// tell.
func holders(d Device) string {
	var parts []string
	for _, h := range d.Holders {
		switch {
		case h.Local != "":
			parts = append(parts, fmt.Sprintf("local %s (%s)", h.Local, h.User))
		case len(h.Pods) > 0 && h.Claim != "":
			parts = append(parts, h.Claim+" <- "+strings.Join(h.Pods, ","))
		case len(h.Pods) > 0:
			parts = append(parts, strings.Join(h.Pods, ","))
		default:
			parts = append(parts, h.Claim)
		}
	}
	switch {
	case len(parts) > 0:
		return strings.Join(parts, "; ")
	case d.Free != nil && *d.Free:
		return "free"
	case d.Free != nil:
		return "in use" // a GPU one of whose MIG devices or shares is held
	default:
		return "-"
	}
}

func processName(p Process) string {
	switch {
	case p.Unattributed:
		return "(outside its containers)"
	case p.PID != 0:
		return fmt.Sprintf("pid %d", p.PID)
	default:
		return "container"
	}
}

func processOwner(p Process) string {
	who := p.User
	if p.Container != "" {
		who = p.Container
	}
	if who == "" && !p.Unattributed {
		who = "-"
	}
	if p.Count != nil {
		who += fmt.Sprintf(" (%d processes)", int(*p.Count))
	}
	return strings.TrimSpace(who)
}

func smOf(p Process) string {
	if p.SMUtilization == nil {
		return "-"
	}
	return percent(p.SMUtilization)
}

func percent(v *float64) string {
	if v == nil {
		return "-"
	}
	return fmt.Sprintf("%.0f%%", *v*100)
}

func unit(v *float64, u string) string {
	if v == nil {
		return "-"
	}
	return fmt.Sprintf("%.0f%s", *v, u)
}

// memory is "used/total GiB", "used GiB" without a total, or "-".
func memory(used, total *float64) string {
	const gib = 1 << 30
	switch {
	case used == nil:
		return "-"
	case total == nil:
		return fmt.Sprintf("%.1fGiB", *used/gib)
	default:
		return fmt.Sprintf("%.1f/%.1fGiB", *used/gib, *total/gib)
	}
}
