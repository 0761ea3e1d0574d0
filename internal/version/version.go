// Package version holds the build's version and commit, set by the Makefile
// through -ldflags "-X github.com/gpudra/gpudra/internal/version.Version=...
// -X github.com/gpudra/gpudra/internal/version.Commit=...".
package version

var (
	// Version is the release or git describe of the build.
	Version = "dev"
	// Commit is the git commit the build was made from.
	Commit = "unknown"
)
