package main

import (
	"context"
	"fmt"
	"os"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/gpudra/gpudra/internal/version"
	"github.com/gpudra/gpudra/pkg/component"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/nvml"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
	submitcli "github.com/gpudra/gpudra/pkg/submit/cli"
)

// backendFlags select and open the GPU model.
type backendFlags struct {
	backend    string
	machine    string
	driverRoot string
	nodeName   string
}

func (b *backendFlags) register(fs *pflag.FlagSet) {
	hostname, _ := os.Hostname()
	fs.StringVar(&b.backend, "backend", "nvml", "GPU backend: nvml (the real driver) or sim (a simulated machine)")
	fs.StringVar(&b.machine, "machine", "dgx-h100", fmt.Sprintf("simulated machine for --backend sim: one of %v or a YAML file", sim.BuiltinMachines()))
	fs.StringVar(&b.driverRoot, "driver-root", nvml.DefaultDriverRoot, "where the NVIDIA driver is installed (for --backend nvml)")
	fs.StringVar(&b.nodeName, "node-name", hostname, "node name: names the pool and seeds simulated UUIDs")
	component.EnvVar(fs, "node-name", "NODE_NAME")
}

func (b *backendFlags) open(ctx context.Context) (nvdevice.Interface, error) {
	switch b.backend {
	case "nvml":
		return nvml.New(ctx, nvml.Options{DriverRoot: b.driverRoot})
	case "sim":
		return sim.NewBuiltin(b.machine, b.nodeName)
	default:
		return nil, fmt.Errorf("--backend: unknown backend %q, want nvml or sim", b.backend)
	}
}

func (b *backendFlags) inventory(ctx context.Context) (*nvdevice.Inventory, error) {
	backend, err := b.open(ctx)
	if err != nil {
		return nil, err
	}
	defer backend.Close()
	return backend.Inventory(ctx)
}

func newRootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:           "gpudra",
		Short:         "Inspect NVIDIA GPU nodes for the gpudra DRA driver",
		SilenceUsage:  true,
		SilenceErrors: true,
		// Flags with an environment variable take it when they are not on
		// the command line, parsed as strictly as the flag.
		PersistentPreRunE: func(cmd *cobra.Command, _ []string) error {
			return component.ApplyEnv(cmd.Flags(), os.LookupEnv)
		},
		// --version, as every gpudra binary has it.
		Version: version.Version,
	}
	root.SetVersionTemplate(version.String("gpudra") + "\n")
	root.AddCommand(newInventoryCommand(), newSlicesCommand(), newGroupsCommand(kubeconfigClient), newLocalCommand(), newTopCommand(), newDashboardCommand())
	root.AddCommand(submitcli.Commands(submitcli.KubeconfigClients(pluginUsage))...)
	root.AddCommand(&cobra.Command{
		Use:   "version",
		Short: "Print the version and commit",
		Run:   func(cmd *cobra.Command, _ []string) { fmt.Fprintln(cmd.OutOrStdout(), version.String("gpudra")) },
	})
	return root
}
