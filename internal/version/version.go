// Package version holds the build's version and commit, set by the Makefile
// through -ldflags "-X github.com/gpudra/gpudra/internal/version.Version=...
// -X github.com/gpudra/gpudra/internal/version.Commit=...".
package version

import (
	"fmt"
	"runtime"
)

var (
	// Version is the release (the chart's appVersion) or, for any other
	// build, <appVersion>-dev.<commit> (the Makefile; docs/release.md).
	Version = "dev"
	// Commit is the git commit the build was made from.
	Commit = "unknown"
)

// String is the line every binary prints for --version: the name, the
// version, the commit, and the Go toolchain and platform it was built for.
func String(name string) string {
	return fmt.Sprintf("%s %s (commit %s, %s %s/%s)", name, Version, Commit, runtime.Version(), runtime.GOOS, runtime.GOARCH)
}
