// Package archdocs keeps the map in docs/architecture.md true to the tree:
// every package, command and module it names is a directory of the
// repository that holds Go code (or a go.mod). The check runs as a unit
// test of this package (make test-unit), so a package that is renamed or
// removed without the map fails the build.
package archdocs

import (
	"bufio"
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
)

// pathPattern matches what the map names: a path below one of the
// repository's Go trees, or one of its nested modules alone.
var pathPattern = regexp.MustCompile(`\b(?:(?:pkg|cmd|api|internal|hack)(?:/[A-Za-z0-9_.-]+)+|(?:devcluster|bench|gpusmoke)(?:/[A-Za-z0-9_.-]+)*)`)

// CodeBlock is the first fenced code block after the Markdown heading
// (a line equal to heading, e.g. "## Map").
func CodeBlock(doc []byte, heading string) (string, error) {
	sc := bufio.NewScanner(bytes.NewReader(doc))
	sc.Buffer(make([]byte, 0, 64*1024), 1024*1024)
	var b strings.Builder
	found, in := false, false
	for sc.Scan() {
		line := sc.Text()
		switch {
		case !found:
			found = strings.TrimSpace(line) == heading
		case strings.HasPrefix(line, "```") && in:
			return b.String(), nil
		case strings.HasPrefix(line, "```"):
			in = true
		case in:
			b.WriteString(line)
			b.WriteByte('\n')
		case strings.HasPrefix(line, "## "):
			return "", fmt.Errorf("section %q has no code block", heading)
		}
	}
	if err := sc.Err(); err != nil {
		return "", err
	}
	if !found {
		return "", fmt.Errorf("no section %q", heading)
	}
	return "", fmt.Errorf("section %q: the code block does not end", heading)
}

// Paths are the repository paths text names, in order, each once.
func Paths(text string) []string {
	var out []string
	seen := map[string]bool{}
	for _, p := range pathPattern.FindAllString(text, -1) {
		p = strings.TrimRight(p, ".")
		if !seen[p] {
			seen[p] = true
			out = append(out, p)
		}
	}
	return out
}

// Missing are the paths that name no directory below root holding a .go
// file or a go.mod.
func Missing(root string, paths []string) ([]string, error) {
	var missing []string
	for _, p := range paths {
		entries, err := os.ReadDir(filepath.Join(root, filepath.FromSlash(p)))
		if os.IsNotExist(err) {
			missing = append(missing, p)
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", p, err)
		}
		code := false
		for _, e := range entries {
			name := e.Name()
			if !e.IsDir() && (name == "go.mod" || strings.HasSuffix(name, ".go")) {
				code = true
				break
			}
		}
		if !code {
			missing = append(missing, p)
		}
	}
	return missing, nil
}
