package image

import (
	"bytes"
	"crypto/sha256"
	"debug/buildinfo"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/url"
	"regexp"
	"sort"
	"strings"
)

// The SBOM is SPDX 2.3 JSON (https://spdx.github.io/spdx-spec/v2.3/): the
// image, its binaries (with their SHA-256), the Go modules and toolchain each
// binary was built from, as the binary's own build information records them
// (debug/buildinfo, what `go version -m` prints), and the Debian packages
// with their versions and the .deb's SHA-256.

type spdxDoc struct {
	SPDXVersion       string             `json:"spdxVersion"`
	DataLicense       string             `json:"dataLicense"`
	SPDXID            string             `json:"SPDXID"`
	Name              string             `json:"name"`
	DocumentNamespace string             `json:"documentNamespace"`
	CreationInfo      spdxCreation       `json:"creationInfo"`
	Packages          []spdxPackage      `json:"packages"`
	Relationships     []spdxRelationship `json:"relationships"`
}

type spdxCreation struct {
	Created  string   `json:"created"`
	Creators []string `json:"creators"`
}

type spdxPackage struct {
	SPDXID           string            `json:"SPDXID"`
	Name             string            `json:"name"`
	VersionInfo      string            `json:"versionInfo,omitempty"`
	Supplier         string            `json:"supplier,omitempty"`
	DownloadLocation string            `json:"downloadLocation"`
	FilesAnalyzed    bool              `json:"filesAnalyzed"`
	PrimaryPurpose   string            `json:"primaryPackagePurpose,omitempty"`
	LicenseConcluded string            `json:"licenseConcluded"`
	LicenseDeclared  string            `json:"licenseDeclared"`
	CopyrightText    string            `json:"copyrightText"`
	Checksums        []spdxChecksum    `json:"checksums,omitempty"`
	ExternalRefs     []spdxExternalRef `json:"externalRefs,omitempty"`
	Comment          string            `json:"comment,omitempty"`
}

type spdxChecksum struct {
	Algorithm string `json:"algorithm"`
	Value     string `json:"checksumValue"`
}

type spdxExternalRef struct {
	Category string `json:"referenceCategory"`
	Type     string `json:"referenceType"`
	Locator  string `json:"referenceLocator"`
}

type spdxRelationship struct {
	Element string `json:"spdxElementId"`
	Type    string `json:"relationshipType"`
	Related string `json:"relatedSpdxElement"`
}

var spdxIDUnsafe = regexp.MustCompile(`[^A-Za-z0-9.-]+`)

func spdxID(kind, name, version string) string {
	return "SPDXRef-" + kind + "-" + spdxIDUnsafe.ReplaceAllString(name+"-"+version, "-")
}

const noAssertion = "NOASSERTION"

// SBOM is one architecture's SPDX document. Every binary must be a Go
// binary with build information.
func SBOM(in Inputs, a Arch) ([]byte, error) {
	doc := spdxDoc{
		SPDXVersion: "SPDX-2.3", DataLicense: "CC0-1.0", SPDXID: "SPDXRef-DOCUMENT",
		Name: "gpudra-" + in.Version + "-linux-" + a.Arch,
		// Unique per image and stable per build: the version names the
		// commit, the architecture the image.
		DocumentNamespace: in.Source + "/spdx/" + url.PathEscape(in.Version) + "/linux-" + a.Arch,
		CreationInfo:      spdxCreation{Created: in.created(), Creators: []string{"Tool: gpudra-hack-image", "Organization: gpudra"}},
	}
	imageID := spdxID("image", "gpudra", a.Arch)
	doc.Packages = append(doc.Packages, spdxPackage{
		SPDXID: imageID, Name: "gpudra", VersionInfo: in.Version, DownloadLocation: in.Source, PrimaryPurpose: "CONTAINER",
		LicenseConcluded: noAssertion, LicenseDeclared: "Apache-2.0", CopyrightText: noAssertion,
		ExternalRefs: []spdxExternalRef{{"PACKAGE-MANAGER", "purl", "pkg:oci/gpudra?arch=" + a.Arch}},
		Comment:      "revision " + in.Revision,
	})
	doc.Relationships = append(doc.Relationships, spdxRelationship{"SPDXRef-DOCUMENT", "DESCRIBES", imageID})

	modules := map[string]spdxPackage{}
	var rels []spdxRelationship
	for _, b := range a.Binaries {
		bi, err := buildinfo.Read(bytes.NewReader(b.Data))
		if err != nil {
			return nil, fmt.Errorf("binary %s: no Go build information: %w", b.Name, err)
		}
		sum := sha256.Sum256(b.Data)
		binID := spdxID("binary", b.Name, a.Arch)
		var settings []string
		for _, s := range bi.Settings {
			if s.Key == "CGO_ENABLED" || s.Key == "GOARCH" || s.Key == "GOOS" || s.Key == "-trimpath" {
				settings = append(settings, s.Key+"="+s.Value)
			}
		}
		doc.Packages = append(doc.Packages, spdxPackage{
			SPDXID: binID, Name: b.Name, VersionInfo: in.Version, DownloadLocation: in.Source, PrimaryPurpose: "APPLICATION",
			LicenseConcluded: noAssertion, LicenseDeclared: "Apache-2.0", CopyrightText: noAssertion,
			Checksums: []spdxChecksum{{"SHA256", hex.EncodeToString(sum[:])}},
			Comment:   BinDir + "/" + b.Name + ", package " + bi.Path + ", built with " + strings.Join(settings, " "),
		})
		rels = append(rels, spdxRelationship{imageID, "CONTAINS", binID})

		deps := []*moduleRef{{path: "stdlib", version: bi.GoVersion, purl: "pkg:golang/stdlib@" + bi.GoVersion}}
		for _, d := range bi.Deps {
			m := d
			if d.Replace != nil {
				m = d.Replace
			}
			deps = append(deps, &moduleRef{path: m.Path, version: m.Version, sum: m.Sum,
				purl: "pkg:golang/" + m.Path + "@" + m.Version})
		}
		for _, d := range deps {
			id := spdxID("gomod", d.path, d.version)
			if _, ok := modules[id]; !ok {
				p := spdxPackage{
					SPDXID: id, Name: d.path, VersionInfo: d.version, DownloadLocation: noAssertion, PrimaryPurpose: "LIBRARY",
					LicenseConcluded: noAssertion, LicenseDeclared: noAssertion, CopyrightText: noAssertion,
					ExternalRefs: []spdxExternalRef{{"PACKAGE-MANAGER", "purl", d.purl}},
				}
				if d.sum != "" {
					p.Comment = "go.sum " + d.sum
				}
				modules[id] = p
			}
			rels = append(rels, spdxRelationship{binID, "DEPENDS_ON", id})
		}
	}
	ids := make([]string, 0, len(modules))
	for id := range modules {
		ids = append(ids, id)
	}
	sort.Strings(ids)
	for _, id := range ids {
		doc.Packages = append(doc.Packages, modules[id])
	}
	for _, p := range a.Debs {
		id := spdxID("deb", p.Deb.Package, p.Deb.Version+"-"+p.Deb.Arch)
		doc.Packages = append(doc.Packages, spdxPackage{
			SPDXID: id, Name: p.Deb.Package, VersionInfo: p.Deb.Version, Supplier: "Organization: Debian",
			DownloadLocation: p.Deb.URL, PrimaryPurpose: "OPERATING-SYSTEM",
			LicenseConcluded: noAssertion, LicenseDeclared: noAssertion, CopyrightText: noAssertion,
			Checksums: []spdxChecksum{{"SHA256", p.Deb.SHA256}},
			ExternalRefs: []spdxExternalRef{{"PACKAGE-MANAGER", "purl",
				"pkg:deb/debian/" + p.Deb.Package + "@" + url.QueryEscape(p.Deb.Version) + "?arch=" + p.Deb.Arch + "&distro=debian-12"}},
			Comment: "the image ships the files of it that the binaries and the driver need; /usr/share/doc/" + p.Deb.Package + "/copyright in the image says their licenses",
		})
		rels = append(rels, spdxRelationship{imageID, "CONTAINS", id})
	}
	doc.Relationships = append(doc.Relationships, rels...)
	out, err := json.MarshalIndent(doc, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("sbom: %w", err)
	}
	return append(out, '\n'), nil
}

type moduleRef struct{ path, version, sum, purl string }
