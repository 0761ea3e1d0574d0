package image

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/layout"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// Repository is the image's name; the tarballs tag it with the version.
const Repository = "ghcr.io/gpudra/gpudra"

// Outputs are the paths Write wrote.
type Outputs struct {
	Layout   string            // the OCI image layout: the index of every architecture
	Tarballs map[string]string // per architecture: docker load, ctr images import, kind load image-archive
	SBOMs    map[string]string // per architecture
	Index    v1.Hash
}

// TarballName is one architecture's tarball in the output directory.
func TarballName(version, arch string) string {
	return fmt.Sprintf("gpudra-%s-%s.tar", version, arch)
}

// Write writes res into dir (made empty first): dir/oci, an OCI layout whose
// index.json names the index as <version>; dir/gpudra-<version>-<arch>.tar,
// a `docker save` tarball per architecture tagged Repository:<version>
// (docker load and kind load take one platform per tarball); and
// dir/sbom-<arch>.spdx.json.
func Write(dir, version string, res *Result) (*Outputs, error) {
	tag, err := name.NewTag(Repository + ":" + version)
	if err != nil {
		return nil, fmt.Errorf("tag for version %q: %w", version, err)
	}
	if err := os.RemoveAll(dir); err != nil {
		return nil, fmt.Errorf("clear %s: %w", dir, err)
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("create %s: %w", dir, err)
	}
	out := &Outputs{Layout: filepath.Join(dir, "oci"), Tarballs: map[string]string{}, SBOMs: map[string]string{}}
	if out.Index, err = res.Index.Digest(); err != nil {
		return nil, fmt.Errorf("index digest: %w", err)
	}
	lp, err := layout.Write(out.Layout, empty.Index)
	if err != nil {
		return nil, fmt.Errorf("OCI layout %s: %w", out.Layout, err)
	}
	if err := lp.AppendIndex(res.Index, layout.WithAnnotations(map[string]string{
		"org.opencontainers.image.ref.name": version,
	})); err != nil {
		return nil, fmt.Errorf("OCI layout %s: %w", out.Layout, err)
	}
	for _, ai := range res.Images {
		p := filepath.Join(dir, TarballName(version, ai.Arch))
		if err := tarball.MultiRefWriteToFile(p, map[name.Reference]v1.Image{tag: ai.Image}); err != nil {
			return nil, fmt.Errorf("tarball %s: %w", p, err)
		}
		out.Tarballs[ai.Arch] = p
		s := filepath.Join(dir, "sbom-"+ai.Arch+".spdx.json")
		if err := os.WriteFile(s, ai.SBOM, 0o644); err != nil {
			return nil, fmt.Errorf("SBOM: %w", err)
		}
		out.SBOMs[ai.Arch] = s
	}
	return out, nil
}
