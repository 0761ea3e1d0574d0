package nvdevice

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
)

// WriteTable writes the inventory as `gpudra inventory` prints it: the
// GPUs, the MIG profile table of the first GPU, and the MIG devices.
func (inv *Inventory) WriteTable(w io.Writer) error {
	fmt.Fprintf(w, "Driver %s, CUDA %s, %d GPU(s)\n\n", inv.DriverVersion, inv.CUDADriverVersion, len(inv.GPUs))
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "INDEX\tMINOR\tPRODUCT\tMEMORY\tCC\tSMS\tPCI BUS\tNUMA\tMIG\tNVLINK\tDOMAIN\tUUID")
	for _, g := range inv.GPUs {
		mig := "n/a"
		if g.MIG.Capable {
			mig = map[bool]string{true: "enabled", false: "disabled"}[g.MIG.Enabled]
		}
		domain := g.NVLink.Domain
		if domain == "" {
			domain = "-"
		}
		fmt.Fprintf(tw, "%d\t%d\t%s\t%d MiB\t%s\t%d\t%s\t%d\t%s\t%d/%d\t%s\t%s\n",
			g.Index, g.Minor, g.ProductName, g.MemoryMiB, g.CUDAComputeCapability, g.Engines.Multiprocessors,
			g.PCI.BusID, g.NUMANode, mig, g.NVLink.ActiveLinks(), len(g.NVLink.Links), domain, g.UUID)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(inv.GPUs) == 0 || !inv.GPUs[0].MIG.Capable {
		return nil
	}
	// Every GPU of a node is the same part, so the profile table is shown once.
	fmt.Fprintf(w, "\nMIG profiles (GPU %d; placements are start:size in memory slices):\n", inv.GPUs[0].Index)
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "PROFILE\tID\tMAX\tMEMORY\tSMS\tCE\tDEC\tJPEG\tOFA\tPLACEMENTS")
	for _, p := range inv.GPUs[0].MIG.Profiles {
		var pls []string
		for _, pl := range p.Placements {
			pls = append(pls, pl.String())
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d MiB\t%d\t%d\t%d\t%d\t%d\t%s\n", p.Name, p.ID, p.MaxInstances, p.MemoryMiB,
			p.Engines.Multiprocessors, p.Engines.CopyEngines, p.Engines.Decoders, p.Engines.JPEGEngines, p.Engines.OFAEngines,
			strings.Join(pls, " "))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	var devs []MigDevice
	for _, g := range inv.GPUs {
		devs = append(devs, g.MIG.Devices...)
	}
	if len(devs) == 0 {
		return nil
	}
	fmt.Fprintln(w, "\nMIG devices:")
	tw = tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "GPU\tPROFILE\tPLACEMENT\tGI\tCI\tUUID")
	for _, d := range devs {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%d\t%d\t%s\n", d.ParentIndex, d.Profile, d.Placement, d.GPUInstanceID, d.ComputeInstanceID, d.UUID)
	}
	return tw.Flush()
}
