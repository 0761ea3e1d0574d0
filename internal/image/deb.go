package image

import (
	"archive/tar"
	"bufio"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"path"
	"strconv"
	"strings"

	"github.com/ulikunitz/xz"
)

// Deb is one line of the lock file (hack/image/debian.lock): a Debian
// package the image takes files from, pinned to a version and the SHA-256
// of its .deb, so that a mirror serving other bytes is refused rather than
// built into the image.
type Deb struct {
	Package string
	Version string
	Arch    string // Debian's architecture name, which for amd64 and arm64 is GOARCH's
	SHA256  string // hex
	URL     string
}

// ParseLock reads the lock file: one package a line, "package version arch
// sha256 url"; '#' starts a comment.
func ParseLock(r io.Reader) ([]Deb, error) {
	var debs []Deb
	sc := bufio.NewScanner(r)
	for n := 1; sc.Scan(); n++ {
		line := strings.TrimSpace(sc.Text())
		if i := strings.IndexByte(line, '#'); i >= 0 {
			line = strings.TrimSpace(line[:i])
		}
		if line == "" {
			continue
		}
		f := strings.Fields(line)
		if len(f) != 5 {
			return nil, fmt.Errorf("line %d: want \"package version arch sha256 url\", got %d fields", n, len(f))
		}
		if b, err := hex.DecodeString(f[3]); err != nil || len(b) != sha256.Size {
			return nil, fmt.Errorf("line %d: %s's checksum %q is not a hex SHA-256", n, f[0], f[3])
		}
		debs = append(debs, Deb{Package: f[0], Version: f[1], Arch: f[2], SHA256: strings.ToLower(f[3]), URL: f[4]})
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("read lock file: %w", err)
	}
	return debs, nil
}

// Verify refuses data whose SHA-256 is not the lock's.
func (d Deb) Verify(data []byte) error {
	sum := sha256.Sum256(data)
	if got := hex.EncodeToString(sum[:]); got != d.SHA256 {
		return fmt.Errorf("debian package %s %s (%s): SHA-256 %s, but the lock file pins %s", d.Package, d.Version, d.Arch, got, d.SHA256)
	}
	return nil
}

func (d Deb) String() string { return d.Package + "_" + d.Version + "_" + d.Arch }

// debFile is one entry of a package's data.tar.
type debFile struct {
	mode int64 // permission bits
	data []byte
	link string // symlink target, as the package has it
	dir  bool
}

// readDeb returns the files of a .deb's data.tar by their absolute path. A
// .deb is an ar archive of debian-binary, control.tar.* and data.tar.*;
// bookworm compresses with xz.
func readDeb(data []byte) (map[string]debFile, error) {
	const magic = "!<arch>\n"
	if !bytes.HasPrefix(data, []byte(magic)) {
		return nil, errors.New("not an ar archive")
	}
	rest := data[len(magic):]
	for len(rest) > 0 {
		if len(rest) < 60 {
			return nil, errors.New("truncated ar header")
		}
		hdr := rest[:60]
		name := strings.TrimSuffix(strings.TrimSpace(string(hdr[:16])), "/")
		size, err := strconv.ParseInt(strings.TrimSpace(string(hdr[48:58])), 10, 64)
		if err != nil || size < 0 || size > int64(len(rest)-60) {
			return nil, fmt.Errorf("ar member %q: bad size %q", name, hdr[48:58])
		}
		body := rest[60 : 60+size]
		rest = rest[60+size:]
		if size%2 == 1 && len(rest) > 0 { // members are 2-byte aligned
			rest = rest[1:]
		}
		if !strings.HasPrefix(name, "data.tar") {
			continue
		}
		var r io.Reader
		switch path.Ext(name) {
		case ".xz":
			if r, err = xz.NewReader(bytes.NewReader(body)); err != nil {
				return nil, fmt.Errorf("%s: %w", name, err)
			}
		case ".gz":
			if r, err = gzip.NewReader(bytes.NewReader(body)); err != nil {
				return nil, fmt.Errorf("%s: %w", name, err)
			}
		case ".tar":
			r = bytes.NewReader(body)
		default:
			return nil, fmt.Errorf("%s: unsupported compression", name)
		}
		return readTar(r)
	}
	return nil, errors.New("no data.tar member")
}

func readTar(r io.Reader) (map[string]debFile, error) {
	files := map[string]debFile{}
	tr := tar.NewReader(r)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			return files, nil
		}
		if err != nil {
			return nil, fmt.Errorf("data.tar: %w", err)
		}
		p := path.Clean("/" + h.Name)
		f := debFile{mode: h.Mode & 0o777}
		switch h.Typeflag {
		case tar.TypeDir:
			f.dir = true
		case tar.TypeSymlink:
			f.link = h.Linkname
		case tar.TypeReg:
			if f.data, err = io.ReadAll(tr); err != nil {
				return nil, fmt.Errorf("data.tar: %s: %w", p, err)
			}
		default:
			continue // hard links, devices: none in the files the image takes
		}
		files[p] = f
	}
}
