package image

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"time"
)

// Binaries are the image's executables, by the names the chart, the MPS
// server pods and users run them.
var Binaries = []string{"gpudra-kubelet-plugin", "gpudra-controller", "gpudra-mps-server", "gpudra"}

// Options are hack/image's flags.
type Options struct {
	Out      string    // output directory (emptied)
	BinDir   string    // BinDir/<arch>/<binary>
	Arches   []string  // GOARCHes, in index order
	Lock     string    // hack/image/debian.lock
	Cache    string    // where downloaded .debs are kept
	License  string    // LICENSE
	Version  string    // git describe
	Revision string    // the commit
	Source   string    // repository URL
	Created  time.Time // SOURCE_DATE_EPOCH
	Log      io.Writer
}

// Run reads the binaries, fetches (or takes from the cache) and verifies the
// Debian packages, builds the image and writes it.
func Run(ctx context.Context, o Options) (*Outputs, error) {
	f, err := os.Open(o.Lock)
	if err != nil {
		return nil, fmt.Errorf("lock file: %w", err)
	}
	debs, err := ParseLock(f)
	f.Close()
	if err != nil {
		return nil, fmt.Errorf("lock file %s: %w", o.Lock, err)
	}
	in := Inputs{Version: o.Version, Revision: o.Revision, Source: o.Source, Created: o.Created}
	if o.License != "" {
		if in.License, err = os.ReadFile(o.License); err != nil {
			return nil, fmt.Errorf("license: %w", err)
		}
	}
	client := &http.Client{Timeout: 5 * time.Minute}
	for _, arch := range o.Arches {
		a := Arch{Arch: arch}
		for _, name := range Binaries {
			data, err := os.ReadFile(filepath.Join(o.BinDir, arch, name))
			if err != nil {
				return nil, fmt.Errorf("%s binary: %w", arch, err)
			}
			a.Binaries = append(a.Binaries, Binary{Name: name, Data: data})
		}
		for _, d := range debs {
			if d.Arch != arch {
				continue
			}
			data, err := FetchDeb(ctx, client, d, o.Cache, o.Log)
			if err != nil {
				return nil, err
			}
			a.Debs = append(a.Debs, Package{Deb: d, Data: data})
		}
		if len(a.Debs) == 0 {
			return nil, fmt.Errorf("lock file %s pins no package for %s", o.Lock, arch)
		}
		in.Arches = append(in.Arches, a)
	}
	res, err := Build(in)
	if err != nil {
		return nil, err
	}
	return Write(o.Out, o.Version, res)
}

// FetchDeb returns the package's .deb, verified: from cacheDir where a copy
// there verifies, else downloaded (and then kept there).
func FetchDeb(ctx context.Context, client *http.Client, d Deb, cacheDir string, log io.Writer) ([]byte, error) {
	cached := filepath.Join(cacheDir, d.String()+".deb")
	if data, err := os.ReadFile(cached); err == nil {
		if d.Verify(data) == nil {
			return data, nil
		}
		fmt.Fprintf(log, "%s: the cached copy does not verify; downloading it again\n", cached)
	}
	fmt.Fprintf(log, "Downloading %s\n", d.URL)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, d.URL, nil)
	if err != nil {
		return nil, fmt.Errorf("debian package %s: %w", d, err)
	}
	resp, err := client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("debian package %s: %w", d, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("debian package %s: GET %s: %s (Debian drops superseded versions from the pool: pin the current one in the lock file, or use snapshot.debian.org's URL)", d, d.URL, resp.Status)
	}
	data, err := io.ReadAll(io.LimitReader(resp.Body, 256<<20))
	if err != nil {
		return nil, fmt.Errorf("debian package %s: %w", d, err)
	}
	if err := d.Verify(data); err != nil {
		return nil, err
	}
	if err := os.MkdirAll(cacheDir, 0o755); err != nil {
		return nil, fmt.Errorf("cache: %w", err)
	}
	tmp := cached + ".tmp"
	if err := os.WriteFile(tmp, data, 0o644); err != nil {
		return nil, fmt.Errorf("cache: %w", err)
	}
	if err := os.Rename(tmp, cached); err != nil {
		return nil, fmt.Errorf("cache: %w", err)
	}
	return data, nil
}
