package archdocs

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const repo = "../.."

// TestArchitectureMapNamesWhatExists: every package, command and module
// the map in docs/architecture.md names exists, and the map names the five
// flows and the devcluster packages.
func TestArchitectureMapNamesWhatExists(t *testing.T) {
	doc, err := os.ReadFile(filepath.Join(repo, "docs", "architecture.md"))
	require.NoError(t, err)
	block, err := CodeBlock(doc, "## Map")
	require.NoError(t, err)
	paths := Paths(block)
	require.NotEmpty(t, paths)
	missing, err := Missing(repo, paths)
	require.NoError(t, err)
	assert.Empty(t, missing, "docs/architecture.md's map names what the tree does not have")
	for _, flow := range []string{"[slices]", "[prepare]", "[gangs]", "[telemetry", "[dashboard"} {
		assert.Contains(t, block, flow, "the map shows the flow")
	}
	for _, p := range []string{"devcluster/controlplane", "devcluster/nodeagent", "devcluster/noderuntime", "devcluster/imagemode",
		"devcluster/groveoperator", "devcluster/chart", "bench/scalebench", "gpusmoke"} {
		assert.Contains(t, paths, p)
	}
}

func TestMissing(t *testing.T) {
	root := t.TempDir()
	for _, f := range []string{"pkg/a/a.go", "bench/go.mod", "docs/x.md", "pkg/empty/.keep"} {
		require.NoError(t, os.MkdirAll(filepath.Dir(filepath.Join(root, f)), 0o755))
		require.NoError(t, os.WriteFile(filepath.Join(root, f), nil, 0o644))
	}
	for _, tc := range []struct {
		name  string
		text  string
		paths []string
		want  []string
	}{
		{name: "a package and a module", text: "pkg/a ─> bench (module)", paths: []string{"pkg/a", "bench"}},
		{name: "a package that is gone", text: "pkg/a, pkg/b.", paths: []string{"pkg/a", "pkg/b"}, want: []string{"pkg/b"}},
		{name: "a directory without Go code", text: "pkg/empty", paths: []string{"pkg/empty"}, want: []string{"pkg/empty"}},
		{name: "each path once, prose left out", text: "the API server, pkg/a and pkg/a again", paths: []string{"pkg/a"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			paths := Paths(tc.text)
			assert.Equal(t, tc.paths, paths)
			missing, err := Missing(root, paths)
			require.NoError(t, err)
			assert.Equal(t, tc.want, missing)
		})
	}
}

func TestCodeBlock(t *testing.T) {
	doc := []byte("# T\n## Flow\n```\nflow\n```\n## Map\ntext\n```\npkg/a\npkg/b\n```\n## Next\n")
	got, err := CodeBlock(doc, "## Map")
	require.NoError(t, err)
	assert.Equal(t, "pkg/a\npkg/b\n", got)
	_, err = CodeBlock(doc, "## Missing")
	assert.ErrorContains(t, err, `no section "## Missing"`)
	_, err = CodeBlock([]byte("## Map\ntext\n## Next\n```\nx\n```\n"), "## Map")
	assert.ErrorContains(t, err, "has no code block")
}
