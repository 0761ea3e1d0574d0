// Command gpudra-cuda-check checks CUDA from inside a container (issue 34):
// it loads the libcuda.so.1 the CDI spec mounted, without cgo (purego),
// lists the devices CUDA gives the process and allocates --alloc bytes on
// one of them, then prints one JSON line (cudacheck.Result) and one line
// for people. Exit status: 0 ok, 1 a CUDA call failed (the allocation
// included), 2 usage, 3 no device (no libcuda, or CUDA_ERROR_NO_DEVICE).
//
// Unlike gpudra-probe it is dynamically linked even with CGO_ENABLED=0: it
// needs the container's libc and loader (devcluster's host-/usr image).
package main

import (
	"errors"
	"fmt"
	"os"

	"github.com/spf13/pflag"

	"github.com/gpudra/gpudra/pkg/probe/cudacheck"
	"github.com/gpudra/gpudra/pkg/probe/cudacheck/libcuda"
)

func main() {
	fs := pflag.NewFlagSet(cudacheck.Name, pflag.ContinueOnError)
	alloc := fs.String("alloc", "", "allocate this much device memory (a quantity: 1Gi, 512Mi); nothing when empty")
	device := fs.Int("device", 0, "the CUDA device ordinal to allocate on")
	hold := fs.Duration("hold", 0, "keep the --alloc allocation this long before freeing it, writing it over with the GPU meanwhile (cuMemsetD8_v2), so that NVML sees a busy process (the telemetry checks)")
	lib := fs.String("libcuda", "", "the libcuda file to load (default: "+libcuda.Soname+" through the dynamic loader, then a mounted "+libcuda.Soname+")")
	if err := fs.Parse(os.Args[1:]); errors.Is(err, pflag.ErrHelp) {
		os.Exit(0)
	} else if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", cudacheck.Name, err)
		os.Exit(2)
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "%s: unexpected arguments %q\n", cudacheck.Name, fs.Args())
		os.Exit(2)
	}
	cfg := cudacheck.Config{Device: *device, Hold: *hold}
	if *hold > 0 && *alloc == "" {
		fmt.Fprintf(os.Stderr, "%s: --hold needs --alloc (what to hold)\n", cudacheck.Name)
		os.Exit(2)
	}
	if *alloc != "" {
		n, err := cudacheck.ParseSize(*alloc)
		if err != nil {
			fmt.Fprintf(os.Stderr, "%s: --alloc: %v\n", cudacheck.Name, err)
			os.Exit(2)
		}
		cfg.AllocBytes = n
	}
	var r cudacheck.Result
	d, file, err := libcuda.Open(*lib)
	if err != nil {
		r = cudacheck.Unloadable(err)
		r.Library = file
	} else {
		r = cudacheck.Run(d, cfg)
		r.Library = file
	}
	if err := cudacheck.Write(os.Stdout, r); err != nil {
		os.Exit(1)
	}
	os.Exit(r.ExitCode())
}
