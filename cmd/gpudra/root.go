package main

import (
	"context"
	"fmt"
	"os"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/gpudra/gpudra/internal/version"
	"github.com/gpudra/gpudra/pkg/nvdevice"
	"github.com/gpudra/gpudra/pkg/nvdevice/nvml"
	"github.com/gpudra/gpudra/pkg/nvdevice/sim"
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
	fs.StringVar(&b.nodeName, "node-name", envOr("NODE_NAME", hostname), "node name: names the pool and seeds simulated UUIDs")
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

func envOr(key, def string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return def
}

func newRootCommand() *cobra.Command {
	root := &cobra.Command{
		Use:           "gpudra",
		Short:         "Inspect NVIDIA GPU nodes for the gpudra DRA driver",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(newInventoryCommand(), newSlicesCommand(), &cobra.Command{
		Use:   "version",
		Short: "Print the version",
		Run:   func(cmd *cobra.Command, _ []string) { fmt.Fprintln(cmd.OutOrStdout(), version.Version) },
	})
	return root
}
