package main

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"

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
	return inv.WriteTable(w)
}
