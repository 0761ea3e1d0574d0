package main

import (
	"encoding/json"
	"fmt"
	"io"
	"text/tabwriter"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"

	"github.com/spf13/cobra"
	"sigs.k8s.io/yaml"

	"github.com/gpudra/gpudra/pkg/machinetype"
	"github.com/gpudra/gpudra/pkg/slicebuilder"
)

func newSlicesCommand() *cobra.Command {
	var b backendFlags
	var output string
	var fractional, migMode bool
	var migDevices string
	cmd := &cobra.Command{
		Use:   "slices",
		Short: "Print the ResourceSlices the kubelet plugin would publish for this node",
		Long: `Print the ResourceSlices the kubelet plugin would publish for this node: full GPUs and,
on GPUs in MIG mode, the MIG placements that --mig-devices publishes (as the plugin's flag)
as partitionable devices consuming one shared counter set per GPU.
The YAML can be checked against a cluster with 'kubectl apply --dry-run=server -f -'.

--machine also takes a cloud machine type (p5.48xlarge, a3-highgpu-8g, Standard_ND96isr_H100_v5,
p5e.48xlarge, p5en.48xlarge, a3-ultragpu-8g; MIG mode off unless --mig-mode) with --backend sim, and
-o karpenter prints what a fresh node of the type (cloud or simulated) publishes as an autoscaler's
templates (Karpenter's InstanceType.DynamicResources.ResourceSliceTemplates), whatever --backend says.
A fresh node has no MIG device: under --mig-devices existing its GPUs in MIG mode publish nothing.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := checkOutput(output, "yaml", "json", "table", "karpenter"); err != nil {
				return err
			}
			policy, err := slicebuilder.ParseMigPolicy(migDevices)
			if err != nil {
				return fmt.Errorf("--mig-devices: %w", err)
			}
			opts := slicebuilder.Options{FractionalGPUs: fractional, Mig: policy}
			if output == "karpenter" {
				typ, err := machinetype.Lookup(b.machine)
				if err != nil {
					return fmt.Errorf("--machine: %w", err)
				}
				tmpl, err := machinetype.TemplatesOf(cmd.Context(), typ, migMode, migDevices, opts)
				if err != nil {
					return err
				}
				out, err := yaml.Marshal(tmpl)
				if err != nil {
					return err
				}
				_, err = cmd.OutOrStdout().Write(out)
				return err
			}
			var objs []resourceapi.ResourceSlice
			if typ, err := machinetype.Lookup(b.machine); err == nil && typ.Provider != "" && b.backend == "sim" {
				if objs, err = machinetype.Slices(cmd.Context(), typ, migMode, b.nodeName, opts); err != nil {
					return err
				}
			} else {
				inv, err := b.inventory(cmd.Context())
				if err != nil {
					return err
				}
				res, err := slicebuilder.Build(inv, b.nodeName, opts)
				if err != nil {
					return err
				}
				objs = slicebuilder.ResourceSlices(res, b.nodeName)
			}
			if output == "table" {
				return printSliceTable(cmd.OutOrStdout(), objs)
			}
			return printSlices(cmd.OutOrStdout(), objs, output)
		},
	}
	b.register(cmd.Flags())
	cmd.Flags().StringVarP(&output, "output", "o", "yaml", "output format: yaml (one document per slice), json (a List), table, or karpenter (a fresh node's slices as an autoscaler's templates)")
	cmd.Flags().BoolVar(&migMode, "mig-mode", false, "with a cloud machine type: its GPUs in MIG mode (the clouds deliver them with MIG mode off)")
	cmd.Flags().StringVar(&migDevices, "mig-devices", slicebuilder.MigPolicyExisting, "as the plugin does with --mig-devices (and its default): existing, profiles=<profile>,..., or all")
	cmd.Flags().BoolVar(&fractional, "fractional-gpus", false, "as the plugin does with --fractional-gpus: whole GPUs with MIG off shared through consumable capacity")
	return cmd
}

func printSlices[T any](w io.Writer, objs []T, output string) error {
	if output == "json" {
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		return enc.Encode(map[string]any{"apiVersion": "v1", "kind": "List", "items": objs})
	}
	for i, o := range objs {
		b, err := yaml.Marshal(o)
		if err != nil {
			return err
		}
		if i > 0 {
			fmt.Fprintln(w, "---")
		}
		if _, err := w.Write(b); err != nil {
			return err
		}
	}
	return nil
}

// printSliceTable shows one line per device and per counter set.
func printSliceTable(w io.Writer, objs []resourceapi.ResourceSlice) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SLICE\tDEVICE\tTYPE\tPROFILE\tMEMORY\tSMS\tCOUNTER SET")
	devices, sets := 0, 0
	for _, s := range objs {
		for _, cs := range s.Spec.SharedCounters {
			sets++
			fmt.Fprintf(tw, "%s\t-\tcounters\t-\t%s\t%s\t%s (%d counters)\n", s.Name,
				quantity(cs.Counters["memory"].Value), quantity(cs.Counters["multiprocessors"].Value), cs.Name, len(cs.Counters))
		}
		for _, d := range s.Spec.Devices {
			devices++
			set := "-"
			if len(d.ConsumesCounters) > 0 {
				set = d.ConsumesCounters[0].CounterSet
			}
			fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\n", s.Name, d.Name, attr(d, "type"), attr(d, "migProfile"),
				quantity(d.Capacity["memory"].Value), quantity(d.Capacity["multiprocessors"].Value), set)
		}
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	_, err := fmt.Fprintf(w, "\n%d slices, %d devices, %d counter sets\n", len(objs), devices, sets)
	return err
}

func attr(d resourceapi.Device, name resourceapi.QualifiedName) string {
	if a, ok := d.Attributes[name]; ok && a.StringValue != nil {
		return *a.StringValue
	}
	return "-"
}

func quantity(q resource.Quantity) string {
	if q.IsZero() {
		return "-"
	}
	return q.String()
}
