// Command image builds gpudra's container image (make image; docs/image.md)
// from binaries already built for each architecture: an OCI layout with the
// index of every architecture and a docker-loadable tarball per
// architecture, with no Docker and no registry. The recipe is
// internal/image.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"time"

	"github.com/gpudra/gpudra/internal/image"
)

func main() {
	o := image.Options{Log: os.Stderr}
	var arches string
	epoch := os.Getenv("SOURCE_DATE_EPOCH")
	flag.StringVar(&o.Out, "out", "bin/image", "output directory (emptied first)")
	flag.StringVar(&o.BinDir, "bin", "bin/image-build", "directory of the binaries: <bin>/<arch>/<name>")
	flag.StringVar(&arches, "arches", "amd64,arm64", "architectures (GOARCH), in index order")
	flag.StringVar(&o.Lock, "lock", "hack/image/debian.lock", "the pinned Debian packages")
	flag.StringVar(&o.Cache, "cache", "bin/debian-cache", "where downloaded packages are kept")
	flag.StringVar(&o.License, "license", "LICENSE", "the license shipped in the image")
	flag.StringVar(&o.Version, "version", "", "the version (git describe): tag and label")
	flag.StringVar(&o.Revision, "revision", "", "the commit")
	flag.StringVar(&o.Source, "source", "https://github.com/gpudra/gpudra", "the source repository")
	flag.StringVar(&epoch, "source-date-epoch", epoch, "every timestamp in the image, in seconds since 1970 (default $SOURCE_DATE_EPOCH, else 0)")
	flag.Parse()
	o.Arches = strings.Split(arches, ",")
	secs := int64(0)
	if epoch != "" {
		var err error
		if secs, err = strconv.ParseInt(epoch, 10, 64); err != nil {
			fmt.Fprintf(os.Stderr, "image: --source-date-epoch %q: %v\n", epoch, err)
			os.Exit(2)
		}
	}
	o.Created = time.Unix(secs, 0).UTC()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	out, err := image.Run(ctx, o)
	if err != nil {
		fmt.Fprintf(os.Stderr, "image: %v\n", err)
		os.Exit(1)
	}
	fmt.Printf("OCI layout  %s\n", out.Layout)
	for _, a := range o.Arches {
		fmt.Printf("tarball     %s\nSBOM        %s\n", out.Tarballs[a], out.SBOMs[a])
	}
	fmt.Printf("index       %s\n", out.Index)
}
