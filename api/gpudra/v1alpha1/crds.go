package v1alpha1

import (
	"embed"
	"fmt"
	"io/fs"
	"slices"
)

// The CRD manifests are embedded so that the controller (and the
// devcluster) can install them without the chart; the chart carries
// byte-identical copies in deployments/helm/gpudra/crds.
//
//go:embed crds/*.yaml
var crdFS embed.FS

// CRDs returns the CRD manifests (YAML), sorted by file name so the order
// is stable.
func CRDs() ([][]byte, error) {
	names, err := fs.Glob(crdFS, "crds/*.yaml")
	if err != nil {
		return nil, fmt.Errorf("listing embedded CRDs: %w", err)
	}
	slices.Sort(names)
	out := make([][]byte, 0, len(names))
	for _, n := range names {
		b, err := crdFS.ReadFile(n)
		if err != nil {
			return nil, fmt.Errorf("reading embedded CRD %s: %w", n, err)
		}
		out = append(out, b)
	}
	return out, nil
}
