package chartdocs

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

const chartDir = "../../deployments/helm/gpudra"

func readChart(t *testing.T) (values []Value, readme []byte) {
	t.Helper()
	valuesYAML, err := os.ReadFile(filepath.Join(chartDir, "values.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	schema, err := os.ReadFile(filepath.Join(chartDir, "values.schema.json"))
	if err != nil {
		t.Fatal(err)
	}
	values, err = Values(valuesYAML, schema)
	if err != nil {
		t.Fatal(err)
	}
	readme, err = os.ReadFile(filepath.Join(chartDir, "README.md"))
	if err != nil {
		t.Fatal(err)
	}
	return values, readme
}

// The chart README's values table lists every value of values.yaml, and
// nothing else, with its type and default.
func TestChartREADMEMatchesValues(t *testing.T) {
	values, readme := readChart(t)
	rows, err := TableRows(readme)
	if err != nil {
		t.Fatalf("deployments/helm/gpudra/README.md: %v", err)
	}
	for _, p := range Check(values, rows) {
		t.Error(p)
	}
	if len(values) == 0 || len(rows) == 0 {
		t.Fatalf("%d values, %d rows: nothing compared", len(values), len(rows))
	}
}

// Removing any one row of the real README is caught, naming the value.
func TestChartREADMEWithARowRemovedFails(t *testing.T) {
	values, readme := readChart(t)
	rows, err := TableRows(readme)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(readme), "\n")
	for _, r := range rows {
		t.Run(r.Key, func(t *testing.T) {
			without := append(append([]string{}, lines[:r.Line-1]...), lines[r.Line:]...)
			got, err := TableRows([]byte(strings.Join(without, "\n")))
			if err != nil {
				t.Fatal(err)
			}
			problems := Check(values, got)
			if len(problems) != 1 || !strings.Contains(problems[0], "`"+r.Key+"` has no row") {
				t.Errorf("row %s removed: problems %q, want one naming it", r.Key, problems)
			}
		})
	}
}

const testSchema = `{
  "definitions": {"stringMap": {"type": "object", "additionalProperties": {"type": "string"}}},
  "properties": {
    "image": {"type": "object", "properties": {"tag": {"type": "string"}, "pullPolicy": {"type": "string", "enum": ["Always"]}}},
    "labels": {"$ref": "#/definitions/stringMap"},
    "affinity": {"type": "object"},
    "resources": {"type": "object", "properties": {"requests": {"$ref": "#/definitions/stringMap"}}},
    "surge": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
    "qps": {"type": "number"},
    "name": {"type": ["string", "null"]}
  }
}`

func TestValues(t *testing.T) {
	tests := []struct {
		name   string
		yaml   string
		schema string
		want   []Value
	}{{
		name: "scalars take the schema's type",
		yaml: "image:\n  tag: \"\"\n  pullPolicy: Always\nqps: 100\nsurge: 1\nname: x\n",
		want: []Value{
			{Key: "image.pullPolicy", Type: "string", Default: "Always"},
			{Key: "image.tag", Type: "string", Default: ""},
			{Key: "name", Type: "string or null", Default: "x"},
			{Key: "qps", Type: "number", Default: 100.0},
			{Key: "surge", Type: "int or string", Default: 1.0},
		},
	}, {
		name: "a map whose keys are the user's is one value, also when it is not empty",
		yaml: "labels: {}\naffinity:\n  nodeAffinity: {a: b}\n",
		want: []Value{
			{Key: "affinity", Type: "map", Default: map[string]any{"nodeAffinity": map[string]any{"a": "b"}}},
			{Key: "labels", Type: "map", Default: map[string]any{}},
		},
	}, {
		name: "a map the chart defines is walked, its free-form children are values",
		yaml: "resources:\n  requests:\n    cpu: 50m\n",
		want: []Value{{Key: "resources.requests", Type: "map", Default: map[string]any{"cpu": "50m"}}},
	}, {
		name:   "without a schema: non-empty maps are walked, the rest are values with their own kind",
		yaml:   "a:\n  b: 1\n  c: 0.5\n  d: []\n  e: {}\n  f: null\n  g: true\n",
		schema: " ",
		want: []Value{
			{Key: "a.b", Type: "int", Default: 1.0},
			{Key: "a.c", Type: "number", Default: 0.5},
			{Key: "a.d", Type: "list", Default: []any{}},
			{Key: "a.e", Type: "map", Default: map[string]any{}},
			{Key: "a.f", Type: "null", Default: nil},
			{Key: "a.g", Type: "bool", Default: true},
		},
	}, {
		name: "a key the schema does not know gets its own kind",
		yaml: "image:\n  extra: [1]\n",
		want: []Value{{Key: "image.extra", Type: "list", Default: []any{1.0}}},
	}}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			schema := tc.schema
			if schema == "" {
				schema = testSchema
			}
			got, err := Values([]byte(tc.yaml), []byte(schema))
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("got  %#v\nwant %#v", got, tc.want)
			}
		})
	}
}

func TestTableRows(t *testing.T) {
	tests := []struct {
		name    string
		readme  string
		want    []Row
		wantErr string
	}{{
		name: "rows up to the end of the table, escaped pipes",
		readme: "# x\n\n| Key | Type | Default | Description |\n| --- | --- | --- | --- |\n" +
			"| `a.b` | string | `\"\"` | one \\| two |\n|`c`|int|`1`|three|\n\nafter\n| `d` | x | y | z |\n",
		want: []Row{
			{Line: 5, Key: "a.b", Type: "string", Default: "`\"\"`", Description: "one | two"},
			{Line: 6, Key: "c", Type: "int", Default: "`1`", Description: "three"},
		},
	}, {
		name:    "no table",
		readme:  "| Value | Default |\n| --- | --- |\n",
		wantErr: "no values table",
	}, {
		name:    "a key without backticks",
		readme:  "| Key | Type | Default | Description |\n| --- | --- | --- | --- |\n| a | string | `x` | y |\n",
		wantErr: "line 3: the first cell \"a\" is not a key in backticks",
	}, {
		name:    "an unescaped pipe",
		readme:  "| Key | Type | Default | Description |\n| --- | --- | --- | --- |\n| `a` | string | `x` | y | z |\n",
		wantErr: "line 3: 5 cells, want 4",
	}, {
		name:    "two tables",
		readme:  "| Key | Type | Default | Description |\n| --- | --- | --- | --- |\n\n| Key | Type | Default | Description |\n",
		wantErr: "line 4: a second values table",
	}}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got, err := TableRows([]byte(tc.readme))
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("error %v, want one containing %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tc.want) {
				t.Errorf("got  %#v\nwant %#v", got, tc.want)
			}
		})
	}
}

func TestCheck(t *testing.T) {
	values := []Value{
		{Key: "a", Type: "string", Default: ""},
		{Key: "b.c", Type: "int", Default: 2.0},
		{Key: "tolerations", Type: "list", Default: []any{map[string]any{"key": "x"}}},
		{Key: "labels", Type: "map", Default: map[string]any{}},
	}
	good := []Row{
		{Line: 1, Key: "a", Type: "string", Default: "`\"\"`"},
		{Line: 2, Key: "b.c", Type: "int", Default: "`2`"},
		{Line: 3, Key: "tolerations", Type: "list", Default: "one for `x`"},
		{Line: 4, Key: "labels", Type: "map", Default: "`{}`"},
	}
	with := func(change func([]Row) []Row) []Row {
		return change(append([]Row{}, good...))
	}
	tests := []struct {
		name string
		rows []Row
		want []string
	}{{
		name: "in step",
		rows: good,
	}, {
		name: "a value without a row",
		rows: with(func(r []Row) []Row { return r[1:] }),
		want: []string{"values.yaml: `a` has no row in the README's values table; add | `a` | string | `\"\"` |"},
	}, {
		name: "a row that is no value",
		rows: with(func(r []Row) []Row { return append(r, Row{Line: 9, Key: "b", Type: "map", Default: "x"}) }),
		want: []string{"README line 9: `b` is not a value in values.yaml"},
	}, {
		name: "a row twice",
		rows: with(func(r []Row) []Row { return append(r, Row{Line: 9, Key: "a", Type: "string", Default: "`\"\"`"}) }),
		want: []string{"README line 9: `a` is listed twice (first at line 1)"},
	}, {
		name: "a wrong type",
		rows: with(func(r []Row) []Row { r[1].Type = "string"; return r }),
		want: []string{"README line 2: `b.c`: type \"string\", want \"int\""},
	}, {
		name: "a wrong scalar default",
		rows: with(func(r []Row) []Row { r[1].Default = "`3`"; return r }),
		want: []string{"README line 2: `b.c`: default `3`, values.yaml says `2`"},
	}, {
		name: "a scalar default in words",
		rows: with(func(r []Row) []Row { r[0].Default = "empty"; return r }),
		want: []string{"README line 1: `a`: default \"empty\" is not the default in backticks: want `\"\"`"},
	}, {
		name: "an empty map's default in words",
		rows: with(func(r []Row) []Row { r[3].Default = "none"; return r }),
		want: []string{"README line 4: `labels`: default \"none\" is not the default in backticks: want `{}`"},
	}, {
		name: "a list's default as YAML that differs",
		rows: with(func(r []Row) []Row { r[2].Default = "`[]`"; return r }),
		want: []string{"README line 3: `tolerations`: default `[]`, values.yaml says `[{\"key\":\"x\"}]`"},
	}}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			got := Check(values, tc.rows)
			if len(got) != len(tc.want) {
				t.Fatalf("problems %q, want %d: %q", got, len(tc.want), tc.want)
			}
			for i := range got {
				if !strings.HasPrefix(got[i], tc.want[i]) {
					t.Errorf("problem %q, want it to start with %q", got[i], tc.want[i])
				}
			}
		})
	}
}

func TestFormatDefault(t *testing.T) {
	tests := []struct {
		in   any
		want string
	}{
		{"", "`\"\"`"},
		{"ghcr.io/gpudra/gpudra", "`ghcr.io/gpudra/gpudra`"},
		{"true", "`\"true\"`"},
		{"1", "`\"1\"`"},
		{"/", "`/`"},
		{100.0, "`100`"},
		{0.5, "`0.5`"},
		{true, "`true`"},
		{nil, "`null`"},
		{[]any{}, "`[]`"},
		{map[string]any{}, "`{}`"},
	}
	for _, tc := range tests {
		if got := FormatDefault(tc.in); got != tc.want {
			t.Errorf("FormatDefault(%#v) = %s, want %s", tc.in, got, tc.want)
		}
	}
}
