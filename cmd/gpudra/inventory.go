package main

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"
	"sigs.k8s.io/yaml"

	"github.com/gpudra/gpudra/pkg/nvdevice"
)

func newInventoryCommand() *cobra.Command {
	var b backendFlags
	var output string
	cmd := &cobra.Command{
		Use:   "inventory",
		Short: "Show the node's GPUs, MIG profiles and devices, and NVLink domains",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(output, "table", "json", "yaml"); err != nil {
				return err
			}
			inv, err := b.inventory(cmd.Context())
			if err != nil {
				return err
			}
			return printInventory(cmd.OutOrStdout(), inv, output)
		},
	}
	b.register(cmd.Flags())
	cmd.Flags().StringVarP(&output, "output", "o", "table", "output format: table, json or yaml")
	return cmd
}

func checkOutput(got string, allowed ...string) error {
	for _, a := range allowed {
		if got == a {
			return nil
		}
	}
	return fmt.Errorf("--output: unknown format %q, want one of %s", got, strings.Join(allowed, ", "))
}

func printInventory(w io.Writer, inv *nvdevice.Inventory, output string) error {
	switch output {
	case "json":
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(inv)
	case "yaml":
		b, err := yaml.Marshal(inv)
		if err != nil {
			return err
		}
		_, err = w.Write(b)
		return err
	}
	return printInventoryTable(w, inv)
}

func printInventoryTable(w io.Writer, inv *nvdevice.Inventory) error {
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
	var devs []nvdevice.MigDevice
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
