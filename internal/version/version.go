// Package version holds the build's version, set by the Makefile through
// -ldflags "-X github.com/gpudra/gpudra/internal/version.Version=...".
package version

// Version is the release or git describe of the build.
var Version = "dev"
