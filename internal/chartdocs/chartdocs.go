// Package chartdocs keeps the Helm chart's README in step with its values:
// every value in values.yaml has one row in the README's values table, every
// row names a value, and the type and default columns say what values.yaml
// and values.schema.json say. The check runs as a unit test of this package
// (make test-unit).
//
// Which keys are values (the rows of the table): a key whose default is a
// scalar (string, number, bool, null), a list, or a map that is empty or
// whose keys are the user's to choose (its schema declares no "properties":
// nodeSelector, affinity, annotations, resources.requests). A map whose keys
// the chart defines (its schema lists "properties") is documented through its
// keys, not as a row of its own.
package chartdocs

import (
	"bytes"
	"encoding/json"
	"fmt"
	"math"
	"reflect"
	"regexp"
	"sort"
	"strings"

	"sigs.k8s.io/yaml"
)

// Value is one value of the chart: a leaf of values.yaml.
type Value struct {
	// Key is the dotted path, e.g. kubeletPlugin.kubeAPI.qps.
	Key string
	// Type is what the schema accepts (int, number, bool, string, list, map,
	// or several joined by " or "); the default's own kind where the schema
	// says nothing.
	Type string
	// Default is the value in values.yaml, decoded as JSON decodes it
	// (float64, string, bool, nil, []any, map[string]any).
	Default any
}

// Values returns the chart's values in key order. schemaJSON may be empty.
func Values(valuesYAML, schemaJSON []byte) ([]Value, error) {
	var root map[string]any
	if err := yaml.Unmarshal(valuesYAML, &root); err != nil {
		return nil, fmt.Errorf("values.yaml: %w", err)
	}
	var schema map[string]any
	if len(bytes.TrimSpace(schemaJSON)) > 0 {
		if err := json.Unmarshal(schemaJSON, &schema); err != nil {
			return nil, fmt.Errorf("values.schema.json: %w", err)
		}
	}
	s := schemaWalker{root: schema}
	var out []Value
	s.walk("", root, schema, &out)
	sort.Slice(out, func(i, j int) bool { return out[i].Key < out[j].Key })
	return out, nil
}

type schemaWalker struct{ root map[string]any }

func (s schemaWalker) walk(prefix string, m map[string]any, node map[string]any, out *[]Value) {
	for k, v := range m {
		key := k
		if prefix != "" {
			key = prefix + "." + k
		}
		child := s.property(node, k)
		if sub, ok := v.(map[string]any); ok && len(sub) > 0 && (child == nil || hasProperties(child)) {
			s.walk(key, sub, child, out)
			continue
		}
		typ := s.typeOf(child)
		if typ == "" {
			typ = kindOf(v)
		}
		*out = append(*out, Value{Key: key, Type: typ, Default: v})
	}
}

// resolve follows a local "$ref" (#/definitions/x or #/$defs/x).
func (s schemaWalker) resolve(node map[string]any) map[string]any {
	for i := 0; node != nil && i < 16; i++ {
		ref, ok := node["$ref"].(string)
		if !ok {
			return node
		}
		var cur any = s.root
		for _, part := range strings.Split(strings.TrimPrefix(ref, "#/"), "/") {
			m, _ := cur.(map[string]any)
			cur = m[part]
		}
		node, _ = cur.(map[string]any)
	}
	return node
}

func (s schemaWalker) property(node map[string]any, key string) map[string]any {
	node = s.resolve(node)
	if node == nil {
		return nil
	}
	props, _ := node["properties"].(map[string]any)
	child, _ := props[key].(map[string]any)
	return s.resolve(child)
}

func hasProperties(node map[string]any) bool {
	_, ok := node["properties"].(map[string]any)
	return ok
}

var schemaTypeNames = map[string]string{
	"integer": "int", "number": "number", "boolean": "bool", "string": "string",
	"array": "list", "object": "map", "null": "null",
}

// typeOf names what a schema node accepts; "" when it does not say.
func (s schemaWalker) typeOf(node map[string]any) string {
	node = s.resolve(node)
	if node == nil {
		return ""
	}
	var names []string
	add := func(n string) {
		for _, have := range names {
			if have == n {
				return
			}
		}
		if n != "" {
			names = append(names, n)
		}
	}
	switch t := node["type"].(type) {
	case string:
		add(schemaTypeNames[t])
	case []any:
		for _, e := range t {
			if str, ok := e.(string); ok {
				add(schemaTypeNames[str])
			}
		}
	}
	if len(names) == 0 {
		for _, alt := range []string{"anyOf", "oneOf"} {
			list, _ := node[alt].([]any)
			for _, e := range list {
				sub, _ := e.(map[string]any)
				for _, n := range strings.Split(s.typeOf(sub), " or ") {
					add(n)
				}
			}
		}
	}
	if len(names) == 0 {
		if _, ok := node["properties"]; ok {
			add("map")
		} else if _, ok := node["additionalProperties"]; ok {
			add("map")
		}
	}
	return strings.Join(names, " or ")
}

// kindOf names a decoded YAML value's kind.
func kindOf(v any) string {
	switch x := v.(type) {
	case nil:
		return "null"
	case bool:
		return "bool"
	case string:
		return "string"
	case float64:
		if x == math.Trunc(x) {
			return "int"
		}
		return "number"
	case []any:
		return "list"
	case map[string]any:
		return "map"
	}
	return fmt.Sprintf("%T", v)
}

// TableHeader is the header row of the README's values table.
var TableHeader = []string{"Key", "Type", "Default", "Description"}

// Row is one row of the README's values table.
type Row struct {
	Line                            int
	Key, Type, Default, Description string
}

var backticked = regexp.MustCompile("^`([^`]*)`$")

// TableRows returns the rows of the values table: the table whose header is
// TableHeader. Cells are trimmed and `\|` unescaped; a key is the first
// cell without its backticks.
func TableRows(readme []byte) ([]Row, error) {
	lines := strings.Split(string(readme), "\n")
	start := -1
	for i, l := range lines {
		if isHeader(splitRow(l)) {
			if start >= 0 {
				return nil, fmt.Errorf("line %d: a second values table (the first is at line %d)", i+1, start+1)
			}
			start = i
		}
	}
	if start < 0 {
		return nil, fmt.Errorf("no values table: no row | %s |", strings.Join(TableHeader, " | "))
	}
	var rows []Row
	for i := start + 2; i < len(lines); i++ {
		cells := splitRow(lines[i])
		if cells == nil {
			break
		}
		if len(cells) != len(TableHeader) {
			return nil, fmt.Errorf("line %d: %d cells, want %d (escape | inside a cell as \\|)", i+1, len(cells), len(TableHeader))
		}
		m := backticked.FindStringSubmatch(cells[0])
		if m == nil {
			return nil, fmt.Errorf("line %d: the first cell %q is not a key in backticks", i+1, cells[0])
		}
		rows = append(rows, Row{Line: i + 1, Key: m[1], Type: cells[1], Default: cells[2], Description: cells[3]})
	}
	return rows, nil
}

func isHeader(cells []string) bool {
	if len(cells) != len(TableHeader) {
		return false
	}
	for i, c := range cells {
		if !strings.EqualFold(c, TableHeader[i]) {
			return false
		}
	}
	return true
}

// splitRow splits a Markdown table row into trimmed cells; nil when the line
// is not a table row.
func splitRow(line string) []string {
	line = strings.TrimSpace(line)
	if !strings.HasPrefix(line, "|") {
		return nil
	}
	line = strings.TrimPrefix(line, "|")
	var cells []string
	var cur strings.Builder
	for i := 0; i < len(line); i++ {
		switch {
		case line[i] == '\\' && i+1 < len(line) && line[i+1] == '|':
			cur.WriteByte('|')
			i++
		case line[i] == '|':
			cells = append(cells, strings.TrimSpace(cur.String()))
			cur.Reset()
		default:
			cur.WriteByte(line[i])
		}
	}
	if rest := strings.TrimSpace(cur.String()); rest != "" {
		cells = append(cells, rest)
	}
	return cells
}

// Check compares the values with the table's rows and returns every problem,
// each naming the key: a value without a row, a row that is no value, a key
// listed twice, a type that differs, a default that differs. The default
// cell of a scalar, an empty list or an empty map must be the default as
// YAML in backticks (`true`, `""`, `{}`); a longer list or map may be
// described in words, but a cell that is YAML in backticks must match.
func Check(values []Value, rows []Row) []string {
	var problems []string
	byKey := map[string]Value{}
	for _, v := range values {
		byKey[v.Key] = v
	}
	seen := map[string]int{}
	for _, r := range rows {
		if first, dup := seen[r.Key]; dup {
			problems = append(problems, fmt.Sprintf("README line %d: `%s` is listed twice (first at line %d)", r.Line, r.Key, first))
			continue
		}
		seen[r.Key] = r.Line
		v, ok := byKey[r.Key]
		if !ok {
			problems = append(problems, fmt.Sprintf("README line %d: `%s` is not a value in values.yaml (removed or renamed? a map the chart defines is documented through its keys)", r.Line, r.Key))
			continue
		}
		if r.Type != v.Type {
			problems = append(problems, fmt.Sprintf("README line %d: `%s`: type %q, want %q", r.Line, r.Key, r.Type, v.Type))
		}
		if p := checkDefault(v, r.Default); p != "" {
			problems = append(problems, fmt.Sprintf("README line %d: `%s`: %s", r.Line, r.Key, p))
		}
	}
	for _, v := range values {
		if _, ok := seen[v.Key]; !ok {
			problems = append(problems, fmt.Sprintf("values.yaml: `%s` has no row in the README's values table; add | `%s` | %s | %s | <the comment above it in values.yaml> |",
				v.Key, v.Key, v.Type, FormatDefault(v.Default)))
		}
	}
	return problems
}

func checkDefault(v Value, cell string) string {
	want := FormatDefault(v.Default)
	m := backticked.FindStringSubmatch(cell)
	if m == nil {
		if isComposite(v.Default) {
			return "" // described in words
		}
		return fmt.Sprintf("default %q is not the default in backticks: want %s", cell, want)
	}
	var got any
	if err := yaml.Unmarshal([]byte(m[1]), &got); err != nil {
		return fmt.Sprintf("default %s is not YAML: %v", cell, err)
	}
	if !reflect.DeepEqual(normalize(got), normalize(v.Default)) {
		return fmt.Sprintf("default %s, values.yaml says %s", cell, want)
	}
	return ""
}

// isComposite is true for a non-empty list or map.
func isComposite(v any) bool {
	switch x := v.(type) {
	case []any:
		return len(x) > 0
	case map[string]any:
		return len(x) > 0
	}
	return false
}

// normalize makes "empty document" and null the same, and empty
// collections comparable.
func normalize(v any) any {
	switch x := v.(type) {
	case []any:
		if len(x) == 0 {
			return []any{}
		}
	case map[string]any:
		if len(x) == 0 {
			return map[string]any{}
		}
	}
	return v
}

// FormatDefault writes a default as the README's default cell wants it: YAML
// (flow style) in backticks.
func FormatDefault(v any) string {
	switch x := v.(type) {
	case nil:
		return "`null`"
	case string:
		if x == "" {
			return "`\"\"`"
		}
		var back any
		if err := yaml.Unmarshal([]byte(x), &back); err != nil || back != x {
			b, _ := json.Marshal(x)
			return "`" + string(b) + "`"
		}
		return "`" + x + "`"
	case float64:
		if x == math.Trunc(x) && math.Abs(x) < 1e15 {
			return fmt.Sprintf("`%d`", int64(x))
		}
		return fmt.Sprintf("`%v`", x)
	}
	b, err := json.Marshal(v)
	if err != nil {
		return fmt.Sprintf("`%v`", v)
	}
	return "`" + string(b) + "`"
}
